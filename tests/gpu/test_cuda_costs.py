"""GPU seconds in the cost ledger (jetctl/costs.py `gpu_split`): a step row of a trainer on
CUDA carries `cost/train_gpu_s`, `cost/generate_gpu_s` and `cost/publish_gpu_s`, and they
split the row's wall interval. Marked `gpu` like tests/gpu/test_cuda.py (whose trainer it
uses): without CUDA it skips, or fails when JETCTL_GPU_TESTS=1 says a GPU was expected."""

from __future__ import annotations

import time
from pathlib import Path

import pytest

from jetctl.costs import GPU_KEYS, read_costs
from tests.gpu.test_cuda import cuda, submit_group, trainer_for  # noqa: F401  # cuda: the fixture

pytestmark = [pytest.mark.gpu, pytest.mark.timeout(300)]


def test_a_step_on_cuda_prices_its_gpu_seconds(tmp_path: Path) -> None:
    trainer = trainer_for(tmp_path, "lora")
    rows = []
    for _ in range(2):
        t0 = time.monotonic()
        submit_group(trainer)
        scalars = trainer.step_once(wait_s=1.0)
        assert scalars is not None
        rows.append((scalars, time.monotonic() - t0))
    for scalars, _ in rows:
        assert all(k in scalars for k in GPU_KEYS), sorted(scalars)
        assert scalars["cost/train_gpu_s"] > 0 and scalars["cost/publish_gpu_s"] == 0.0
        assert scalars["cost/train_gpu_s"] == pytest.approx(scalars["timing/train_s"])
    # the second row's interval began when the first row was logged: within this loop's turn
    second, wall = rows[1]
    assert sum(second[k] for k in GPU_KEYS) <= wall + 0.05
    costs = read_costs(trainer.steps_log)
    assert costs is not None and costs.train_gpu_s == pytest.approx(
        sum(s["cost/train_gpu_s"] for s, _ in rows))
