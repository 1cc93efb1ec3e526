"""`device: cuda`: the engine contract, bf16 training (LoRA and full) with memory figures,
the tree kernel's exactness, checkpoints that resume across devices, a replica on a second GPU.

Marked `gpu` (not in CI). Run them with scripts/gpu_check.sh, or
`JETCTL_GPU_TESTS=1 pytest -m gpu tests/gpu`. Without CUDA they skip, except when
JETCTL_GPU_TESTS=1 says a GPU was expected: then they fail.
"""

from __future__ import annotations

import asyncio
import math
import os
import threading
from pathlib import Path
from typing import Any

import pytest
import torch

from jetctl.recipe import GenerationConfig, ModelConfig, OptimizerConfig, TrainConfig
from jetctl.server import checkpoint as ckpt
from jetctl.server import merge
from jetctl.server.engines import GenRequest
from jetctl.types import LLMCall, Trajectory
from tests.server.test_engines import ENGINES, check_reply, prompts, serve

pytestmark = [pytest.mark.gpu, pytest.mark.timeout(300)]
CUDA_TOL = 1e-3  # fp32 on CUDA: kernels differ from the reference's by ~1e-5; a version by ~1e-1


@pytest.fixture(autouse=True)
def cuda() -> None:
    if not torch.cuda.is_available():
        if os.environ.get("JETCTL_GPU_TESTS") == "1":
            pytest.fail(f"JETCTL_GPU_TESTS=1 but torch {torch.__version__} sees no CUDA device")
        pytest.skip("needs a CUDA device")


@pytest.mark.parametrize("engine", list(ENGINES))
async def test_engines_keep_the_contract_on_cuda(engine: str) -> None:
    overrides = {"generation": GenerationConfig(device="cuda")} if engine == "hf-replica" else {}
    s = serve(engine, device="cuda", **overrides)
    s.engine.start()
    try:
        reqs = [GenRequest(p, max_tokens=12, temperature=1.0, top_p=1.0) for p in prompts(16)]
        calls = [asyncio.create_task(s.engine.generate(r)) for r in reqs[:8]]
        await asyncio.sleep(0.05)
        await asyncio.to_thread(s.step, seed=1)  # weights change while requests run
        calls += [asyncio.create_task(s.engine.generate(r)) for r in reqs[8:]]
        for req, res in zip(reqs, await asyncio.gather(*calls)):
            check_reply(s, req, res, tol=CUDA_TOL)
        assert {r.model_version for r in await asyncio.gather(
            *(s.engine.generate(r) for r in reqs[:2]))} == {1}
    finally:
        await s.engine.stop()


@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs a second GPU")
async def test_hf_engine_on_a_second_gpu_gets_each_step_within_the_deadline() -> None:
    s = serve("hf-replica", device="cuda:0",
              generation=GenerationConfig(device="cuda:1", publish_timeout_s=5.0))
    s.engine.start()
    try:
        for seed in range(1, 4):
            await asyncio.to_thread(s.step, seed=seed)
            req = GenRequest(prompts(1)[0], max_tokens=8, temperature=1.0, top_p=1.0)
            res = await s.engine.generate(req)
            assert res.model_version == seed
            check_reply(s, req, res, tol=CUDA_TOL)
    finally:
        await s.engine.stop()


def trainer_for(tmp_path: Path, finetune: str, dtype: str = "bfloat16") -> Any:
    from jetctl.server.step import load_trainable
    from jetctl.server.store import TrajectoryStore
    from jetctl.server.trainer import Trainer

    cfg = ModelConfig(
        model="builtin:tiny", device="cuda", dtype=dtype, finetune=finetune,  # type: ignore[arg-type]
        optimizer=OptimizerConfig(lr=1e-2), train=TrainConfig(groups_per_step=1),
    )
    model, _ = load_trainable(cfg)
    store = TrajectoryStore(tmp_path / "store.sqlite")
    trainer = Trainer(model, cfg, store, weights_lock=threading.Lock(),
                      checkpoint_dir=tmp_path / "checkpoints", steps_log=tmp_path / "steps.jsonl")
    store.open(trained_through_step=trainer.resume())
    return trainer


def submit_group(trainer: Any) -> None:
    from jetctl.proto.convert import group_to_pb
    from tests.factories import make_group

    g = make_group(rewards=(0.0, 1.0), version=trainer.version, prompt=(11, 12, 13, 14),
                   completion=(21, 22, 23))
    assert trainer.store.put(g, group_to_pb(g).SerializeToString()).result(5).outcome == "accepted"


@pytest.mark.parametrize("finetune", ["lora", "full"])
def test_a_bf16_step_on_cuda_changes_the_weights_and_logs_memory(
    tmp_path: Path, finetune: str
) -> None:
    trainer = trainer_for(tmp_path, finetune)
    before = {n: p.detach().clone() for n, p in trainer.model.named_parameters() if p.requires_grad}
    submit_group(trainer)
    scalars = trainer.step_once(wait_s=1.0)
    assert scalars is not None and trainer.version == 1
    assert math.isfinite(scalars["loss"]) and math.isfinite(scalars["grad_norm"])
    assert 0 < scalars["memory/peak_allocated_gib"] <= scalars["memory/device_total_gib"]
    assert scalars["memory/reserved_gib"] >= scalars["memory/allocated_gib"] > 0
    after = dict(trainer.model.named_parameters())
    assert any(not torch.equal(before[n], after[n]) for n in before)
    assert all(p.device.type == "cuda" for p in after.values())


def test_a_checkpoint_from_cuda_resumes_on_cpu_and_back(tmp_path: Path) -> None:
    gpu = trainer_for(tmp_path, "full", dtype="float32")
    submit_group(gpu)
    assert gpu.step_once(wait_s=1.0) is not None
    gpu.checkpoint()
    state = {k: v.detach().cpu() for k, v in gpu.model.state_dict().items()}

    from jetctl.server.step import load_trainable

    cfg = gpu.cfg.model_copy(update={"device": "cpu"})
    cpu_model, _ = load_trainable(cfg)
    cpu_opt = torch.optim.AdamW([p for p in cpu_model.parameters() if p.requires_grad])
    restored = ckpt.restore(tmp_path / "checkpoints", cpu_model, cpu_opt)
    assert restored is not None and restored.version == 1
    for k, v in cpu_model.state_dict().items():
        assert torch.equal(v, state[k]), k
    assert all(t.device.type == "cpu" for s in cpu_opt.state.values() for t in s.values()
               if isinstance(t, torch.Tensor) and t.dim() > 0)

    back = trainer_for(tmp_path, "full", dtype="float32")  # CUDA again, from the same folder
    assert back.version == 1
    for k, v in back.model.state_dict().items():
        assert torch.equal(v.cpu(), state[k]), k


def test_tree_packed_logprobs_equal_call_by_call_on_cuda() -> None:
    """The jetctl_tree kernel on CUDA: a GRPO group packed as one tree row scores every
    completion token as running each completion alone does (fp32)."""
    from jetctl.models import load_model
    from jetctl.server.step import token_logprobs

    model, _ = load_model("builtin:tiny", device="cuda", attn_implementation="jetctl_tree",
                          progress=False)
    gen = torch.Generator().manual_seed(0)
    prompt = torch.randint(5, 700, (40,), generator=gen).tolist()
    trajectories = []
    for i in range(6):
        ids = torch.randint(5, 700, (12 + i,), generator=gen).tolist()
        call = LLMCall("m", prompt, ids, [-1.0] * len(ids), model_version=0)
        trajectories.append(Trajectory(id=f"t{i}", group_id="g", task="x", task_id="0",
                                       calls=[call]))

    def scored(mode: str) -> torch.Tensor:
        seqs = [s for t in trajectories for s in merge.timeline_sequences(t, 1.0, mode)]  # type: ignore[arg-type]
        mbs = merge.pack(seqs, mode, 4096)  # type: ignore[arg-type]
        with torch.no_grad():
            lps = torch.cat([token_logprobs(model, mb).cpu() for mb in mbs])
        # the same (sequence, token) order in both modes
        key = torch.cat([mb.seq_index * 100_000 + mb.token_index for mb in mbs])
        return lps[torch.argsort(key)]

    tree, alone = scored("tree"), scored("off")
    assert tree.shape == alone.shape
    assert torch.allclose(tree, alone, atol=1e-4, rtol=1e-5), (tree - alone).abs().max()
