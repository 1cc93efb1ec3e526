"""The bench's baseline loop (`jetctl.bench.sync_loop`) on builtin:tiny: what it generates
with follows the recipe as the swarm's engine does."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

from jetctl.bench.sync_loop import LoopSpec, SyncLoop
from jetctl.recipe import GenerationConfig, load_recipe

pytestmark = [pytest.mark.unit, pytest.mark.timeout(120)]

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(autouse=True)
def _torch_threads() -> Iterator[None]:
    """The loop owns its process (`python -m jetctl.bench.sync_loop`) and sets the process's
    torch threads; in the test process that setting would leak into later tests."""
    threads = torch.get_num_threads()
    yield
    torch.set_num_threads(threads)


def test_the_loop_generates_from_a_copy_in_generation_dtype_refreshed_after_each_step() -> None:
    rec = load_recipe(ROOT / "recipes" / "tiny.yaml")
    model = rec.models["policy"].model_copy(
        update={"generation": GenerationConfig(dtype="bfloat16")})
    spec = LoopSpec(
        model=model.model_dump(mode="json"), task=rec.tasks["digits"].model_dump(mode="json"),
        seconds=60, seed=0, threads=1,
    )
    loop = SyncLoop(spec)
    assert loop.gen_model is not loop.model
    assert {p.dtype for p in loop.gen_model.parameters()} == {torch.bfloat16}
    assert {p.dtype for p in loop.model.parameters()} == {torch.float32}

    groups = loop.rollouts(2)
    assert loop.out["gen_batches"] and all(r.calls for g in groups for r in g)
    for g in groups:  # rewards that differ, so the step moves the weights
        for i, r in enumerate(g):
            r.reward = float(i % 2)
    served = dict(loop.gen_model.named_parameters())
    trained = [(n, p) for n, p in loop.model.named_parameters() if p.requires_grad]
    before = {n: served[n].detach().clone() for n, _ in trained}
    loop.step(groups)
    assert any(not torch.equal(before[n], served[n]) for n, _ in trained)  # refreshed
    for n, p in trained:  # to the trained weights, cast
        assert torch.equal(served[n], p.detach().to(torch.bfloat16)), n


def test_without_generation_dtype_the_loop_generates_on_the_trained_model() -> None:
    rec = load_recipe(ROOT / "recipes" / "tiny.yaml")
    spec = LoopSpec(
        model=rec.models["policy"].model_dump(mode="json"),
        task=rec.tasks["digits"].model_dump(mode="json"), seconds=60, seed=0, threads=1,
    )
    loop = SyncLoop(spec)
    assert loop.gen_model is loop.model and loop.replica is None


def test_with_generation_dtype_auto_the_loop_takes_the_engines_pick_on_this_host() -> None:
    rec = load_recipe(ROOT / "recipes" / "tiny.yaml")
    model = rec.models["policy"].model_copy(update={"generation": GenerationConfig(dtype="auto")})
    spec = LoopSpec(
        model=model.model_dump(mode="json"), task=rec.tasks["digits"].model_dump(mode="json"),
        seconds=60, seed=0, threads=1,
    )
    loop = SyncLoop(spec)
    assert loop.gen_dtype.why.startswith("auto: ")  # measured, as the server's engine measures
    picked = {p.dtype for p in loop.gen_model.parameters()}
    if loop.gen_dtype.dtype == "bfloat16":
        assert loop.gen_model is not loop.model and picked == {torch.bfloat16}
    else:
        assert loop.gen_model is loop.model and picked == {torch.float32}
