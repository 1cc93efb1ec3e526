"""Merged training equals call-by-call training on SmolLM2-135M (LoRA, fp32).

Same check as tests/server/test_merge.py, on the real model and real chats: the bench's
4-call tool agent (one linear timeline) and a GRPO group of G = 8 completions of one
prompt (a prefix tree), at the bench's --quick sizes, under eager attention and under
jetctl_tree (jetctl/kernels/tree_attention.py: the server's and the bench's), which attends
per trie segment on tree rows and is sdpa elsewhere. The reference is a plain loop: every LLM call on its own, no
mask, default positions, each completion token scored from the logits before it, one GRPO
loss (jetctl.server.algorithms.grpo) over all of them. The merged path is the trainer's:
timeline_sequences -> pack -> token_logprobs -> grpo_loss -> backward per micro-batch.
Behaviour logprobs are the reference's own plus noise in [-0.1, 0.1], so every importance
ratio lies inside the clip range and every token carries gradient; LoRA B starts from
small noise instead of zero so that A gets gradient too.

Tolerance: 1e-5 relative, fp32. Both paths compute the same values; matmuls and softmax
sums over other lengths and layouts (a padded batch, a trie row with masked keys whose
exp(finfo.min) is exactly 0) only reduce in another order. fp32 rounds at 6e-8 per op;
through 30 layers and ~500-token rows, measured: log-probs 1.4e-5 absolute, loss 1-2e-7,
linear-timeline gradient 3-3.5e-6 relative. The GRPO group's loss and gradient cancel
(GROUP_RTOL: 5e-5 in fp32); test_group_is_exact_in_float64 holds them to 1e-10 in float64
and shows that merging adds no fp32 error of its own. Real mistakes are orders of
magnitude above these: a position or mask error moves log-probs by 1e-3 or more
(test_merge.py).

Run: ``.venv/bin/pytest -m slow tests/server/test_merge_smollm2.py`` (minutes on 2 idle
cores, 3 min measured; the reference loop runs every call separately).
"""

from __future__ import annotations

import copy
import random
import types
from typing import Any

import pytest
import torch

from jetctl.bench.merge import Workload, build_workloads, trainable_model
from jetctl.models import load_tokenizer
from jetctl.server.algorithms.grpo import grpo_loss
from jetctl.server.merge import MergeMode, pack, timeline_sequences
from jetctl.server.step import token_logprobs
from jetctl.types import Trajectory

pytestmark = [pytest.mark.slow, pytest.mark.timeout(1800)]  # minutes on a busy 2-core box

SMOLLM2 = "builtin:smollm2-135m-instruct"
RTOL = 1e-5  # see the module docstring
# A GRPO group's advantages sum to zero, so the G rollouts' terms of the loss, and of the
# prompt's gradient, cancel: loss and ||g|| are far below the terms summed into them, and
# the same fp32 rounding is a larger fraction of them. Measured fp32 gaps: loss 1.3-1.7e-5,
# gradient 1.5-1.7e-5 relative, while each fp32 path is that far from float64 on its own
# and the float64 paths agree (test_group_is_exact_in_float64).
GROUP_RTOL = 5e-5
CLIP_EPS = 0.2


@pytest.fixture(scope="module", params=["eager", "jetctl_tree"])
def model(request: pytest.FixtureRequest) -> Any:
    lora = trainable_model(SMOLLM2, "lora", request.param)
    gen = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for name, p in lora.named_parameters():
            if "lora_B" in name:
                p.copy_(torch.randn(p.shape, generator=gen) * 1e-3)
    return lora


@pytest.fixture(scope="module")
def workloads() -> dict[str, Workload]:
    tok = load_tokenizer(SMOLLM2, progress=False)
    # the bench's quick sizes: a 4-call agent with contexts ~270 -> ~530 tokens and a group
    # of G = 8 on a ~200-token prompt keep the reference loop to ~3k tokens per case
    agent, group = build_workloads(tok, [1, 3], quick=True)
    return {"agent": agent, "grpo": group}


Key = tuple[str, tuple[int, ...]]  # (trajectory id, context + target): one scored token


def reference(
    model: Any, trajs: list[tuple[Trajectory, float]]
) -> tuple[torch.Tensor, torch.Tensor, list[Key]]:
    """Call by call: (GRPO loss, new logprob of every completion token, their keys)."""
    new, old, adv, keys = [], [], [], []
    for t, a in trajs:
        for c in t.calls:
            tokens = c.prompt_ids + c.completion_ids
            p = len(c.prompt_ids)
            logits = model(input_ids=torch.tensor([tokens])).logits[0, p - 1 : -1]  # [C, V]
            logits = logits.to(torch.promote_types(logits.dtype, torch.float32))
            lp = torch.log_softmax(logits, -1).gather(
                -1, torch.tensor(c.completion_ids)[:, None]
            )[:, 0]  # [C]
            new.append(lp)
            old.append(torch.tensor(c.completion_logprobs))
            adv.append(torch.full((len(c.completion_ids),), a))
            keys += [(t.id, tuple(tokens[: p + k + 1])) for k in range(len(c.completion_ids))]
    new_t = torch.cat(new)
    loss, _ = grpo_loss(new_t, torch.cat(old), torch.cat(adv), clip_eps=CLIP_EPS,
                        normalizer=new_t.numel())
    return loss, new_t, keys


def set_behaviour_logprobs(model: Any, trajs: list[tuple[Trajectory, float]]) -> None:
    """Behaviour logprobs = the current policy's + noise in [-0.1, 0.1] (inside the clip)."""
    rng = random.Random(0)
    with torch.no_grad():
        _, lp, _ = reference(model, trajs)
    it = iter(lp.tolist())
    for t, _ in trajs:
        for c in t.calls:
            c.completion_logprobs = [next(it) + rng.uniform(-0.1, 0.1) for _ in c.completion_ids]


def grads(model: Any) -> torch.Tensor:
    return torch.cat([p.grad.flatten() for p in model.parameters() if p.grad is not None])


def merged(
    model: Any, trajs: list[tuple[Trajectory, float]], mode: MergeMode
) -> tuple[torch.Tensor, dict[Key, float]]:
    """The trainer's path, backward included: (loss, new logprob of every scored token)."""
    seqs = [s for t, a in trajs for s in timeline_sequences(t, a, mode)]
    mbs = pack(seqs, mode, 8192, dtype=next(model.parameters()).dtype)
    assert len(mbs) == 1 and mbs[0].input_ids.shape[0] == 1  # one row: merged or a trie
    n = sum(mb.num_targets for mb in mbs)
    loss = torch.zeros((), dtype=torch.float64)
    got: dict[Key, float] = {}
    for mb in mbs:
        lp = token_logprobs(model, mb)
        keys = [(seqs[s].trajectory_id, tuple(seqs[s].tokens[: i + 1]))
                for s, i in zip(mb.seq_index.tolist(), mb.token_index.tolist())]
        got.update(zip(keys, lp.detach().tolist()))
        mb_loss, stats = grpo_loss(lp, mb.old_logprobs, mb.advantages, clip_eps=CLIP_EPS,
                                   normalizer=n)
        assert stats.clip_fraction == 0.0  # every token carries gradient
        mb_loss.backward()
        loss = loss + mb_loss.detach()
    return loss, got


def rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a.double() - b.double()).norm() / b.double().norm()).item()


@pytest.mark.parametrize(("workload", "mode"), [("agent", "linear"), ("grpo", "tree")])
def test_merged_equals_call_by_call(
    model: Any, workloads: dict[str, Workload], workload: str, mode: MergeMode
) -> None:
    trajs = workloads[workload].trajectories
    set_behaviour_logprobs(model, trajs)
    model.zero_grad(set_to_none=True)
    ref_loss, ref_lp, ref_keys = reference(model, trajs)
    ref_loss.backward()
    ref_grad = grads(model).clone()
    model.zero_grad(set_to_none=True)

    loss, got = merged(model, trajs, mode)
    assert got.keys() == set(ref_keys)
    merged_lp = torch.tensor([got[k] for k in ref_keys])
    lp_gap = (merged_lp - ref_lp.detach()).abs().max().item()
    torch.testing.assert_close(merged_lp, ref_lp.detach(), rtol=RTOL, atol=RTOL)
    # the group's fp32 loss and gradient are held to fp32's own floor, measured against
    # float64 in test_group_is_exact_in_float64 (GROUP_RTOL says why it is above 1e-5)
    rtol = GROUP_RTOL if workload == "grpo" else RTOL
    loss_gap = abs(loss.item() - ref_loss.item()) / abs(ref_loss.item())
    assert loss_gap <= rtol, f"loss differs by {loss_gap:.2e} relative"
    grad_gap = rel(grads(model), ref_grad)
    assert grad_gap <= rtol, f"gradient differs by {grad_gap:.2e} relative"
    print(f"{workload}/{mode}: logprob {lp_gap:.1e}, loss {loss_gap:.1e}, grad {grad_gap:.1e}")
    model.zero_grad(set_to_none=True)


def _rmsnorm_in_own_dtype(self: Any, x: torch.Tensor) -> torch.Tensor:
    variance = x.pow(2).mean(-1, keepdim=True)
    return self.weight * (x * torch.rsqrt(variance + self.variance_epsilon))


def float64_copy(model: Any) -> Any:
    """The model in float64 throughout. transformers computes RMSNorm and eager attention's
    softmax in float32 whatever the model's dtype (made for fp16/bf16); those would leave
    fp32 rounding in a "float64" run, so the copy normalizes in float64 and uses sdpa
    (the same dense mask as eager) where the model was eager."""
    m64 = copy.deepcopy(model).double()
    for module in m64.modules():
        if type(module).__name__.endswith("RMSNorm"):
            module.forward = types.MethodType(_rmsnorm_in_own_dtype, module)
    if m64.config._attn_implementation == "eager":
        m64.set_attn_implementation("sdpa")
    return m64


def test_group_is_exact_in_float64(model: Any, workloads: dict[str, Workload]) -> None:
    """The GRPO group's loss and gradient, where fp32 rounding alone reaches 1-2e-5 relative
    (GROUP_RTOL): in float64 merged and call-by-call agree to far below 1e-5 (so the
    packing is exact), and in fp32 the merged values are as close to the float64 truth as
    the call-by-call ones (so merging adds no error of its own)."""
    trajs = workloads["grpo"].trajectories
    set_behaviour_logprobs(model, trajs)

    def both(m: Any) -> tuple[float, torch.Tensor, float, torch.Tensor]:
        m.zero_grad(set_to_none=True)
        ref_loss = reference(m, trajs)[0]
        ref_loss.backward()
        ref = grads(m).clone()
        m.zero_grad(set_to_none=True)
        loss, _ = merged(m, trajs, "tree")
        out = grads(m).clone()
        m.zero_grad(set_to_none=True)
        return ref_loss.item(), ref, loss.item(), out

    ref_loss32, ref32, loss32, merged32 = both(model)
    ref_loss64, ref64, loss64, merged64 = both(float64_copy(model))
    exact_grad = rel(merged64, ref64)
    exact_loss = abs(loss64 - ref_loss64) / abs(ref_loss64)
    naive_err, merged_err = rel(ref32, ref64), rel(merged32, ref64)
    # the loss is one sum of terms +-|advantage| (ratios ~1) that cancel to far less than
    # their size: its fp32 error is measured against the size of the terms it sums
    sizes = [(sum(len(c.completion_ids) for c in t.calls), abs(a)) for t, a in trajs]
    term_size = sum(n * a for n, a in sizes) / sum(n for n, _ in sizes)
    naive_loss_err = abs(ref_loss32 - ref_loss64) / term_size
    merged_loss_err = abs(loss32 - ref_loss64) / term_size
    print(f"grpo/tree float64: loss gap {exact_loss:.1e}, gradient gap {exact_grad:.1e}; "
          f"fp32 vs float64: loss (of |terms|) call-by-call {naive_loss_err:.1e} merged "
          f"{merged_loss_err:.1e}, gradient call-by-call {naive_err:.1e} merged {merged_err:.1e}")
    assert exact_loss <= 1e-10, f"float64 losses differ by {exact_loss:.2e} relative"
    assert exact_grad <= 1e-10, f"float64 gradients differ by {exact_grad:.2e} relative"
    assert merged_err <= max(2 * naive_err, RTOL), (
        f"merged fp32 gradient is {merged_err:.2e} from float64, call-by-call {naive_err:.2e}"
    )
    assert merged_loss_err <= RTOL, f"merged fp32 loss is off by {merged_loss_err:.2e} of its terms"
