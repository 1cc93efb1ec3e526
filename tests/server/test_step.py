"""`step.train_step` on builtin:tiny: what it leaves when nothing carries signal, and every
algorithm's loss and gradients the same whatever the packing (their normalizers count
tokens, sequences and rollouts of the whole step, never of a micro-batch)."""

from __future__ import annotations

from typing import Any

import pytest
import torch

from jetctl.recipe import ModelConfig, TrainConfig
from jetctl.server import algorithms
from jetctl.server.step import load_trainable, train_step
from jetctl.types import LLMCall, Trajectory

pytestmark = pytest.mark.unit

PROMPT = [11, 12, 13, 14, 15, 16, 17, 18]


def model() -> Any:
    m, _ = load_trainable(ModelConfig(model="builtin:tiny", finetune="full"),
                          attn_implementation="sdpa")
    return m


def group(rewards: tuple[float, ...], seed: int = 0) -> list[Trajectory]:
    """G rollouts of PROMPT, completions of different lengths, logprobs near the model's."""
    gen = torch.Generator().manual_seed(seed)
    out = []
    for i, r in enumerate(rewards):
        ids = torch.randint(20, 700, (3 + i,), generator=gen).tolist()
        lps = (-3.0 + 0.05 * torch.randn(len(ids), generator=gen)).tolist()
        out.append(Trajectory(id=f"t{seed}-{i}", group_id=f"g{seed}", task="x", task_id="0",
                              calls=[LLMCall("policy", PROMPT, ids, lps, 0)], reward=r))
    return out


def test_groups_without_signal_leave_no_gradient() -> None:
    m = model()
    train = TrainConfig()
    result = train_step(m, [group((1.0, 1.0)), group((0.0, 0.0, 0.0), 1)], train,
                        algorithms.make(train), max_grad_norm=1.0)
    assert not result.trained and result.scalars == {}
    assert result.groups_without_signal == 2
    assert all(p.grad is None for p in m.parameters())


@pytest.mark.parametrize("name", algorithms.names())
def test_packing_changes_no_loss_or_gradient(name: str) -> None:
    """merge off with a budget that splits the step into several micro-batches vs one tree
    row: the same loss and gradient (1e-5 relative: fp32 reduction order, test_merge.py)."""
    groups = [group((0.0, 1.0, 0.5, 1.0)), group((1.0, 0.0, 0.0), 1)]
    m = model()
    out = {}
    for mode, budget in (("off", 64), ("tree", 8192)):
        train = TrainConfig(algorithm=name, merge=mode, max_tokens_per_microbatch=budget)  # type: ignore[arg-type]
        result = train_step(m, groups, train, algorithms.make(train), max_grad_norm=1e9)
        grads = torch.cat([p.grad.flatten() for p in m.parameters() if p.grad is not None])
        out[mode] = (result.loss, grads.clone(), result.microbatches)
        m.zero_grad(set_to_none=True)
    assert out["off"][2] > 1 and out["tree"][2] == 1
    assert out["off"][0] == pytest.approx(out["tree"][0], rel=1e-5, abs=1e-8)
    scale = float(out["tree"][1].abs().max())
    assert scale > 0
    assert float((out["off"][1] - out["tree"][1]).abs().max()) < 1e-5 * scale
