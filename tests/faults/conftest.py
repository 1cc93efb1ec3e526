"""Fixtures for the fault tests: a real run (controller in the test process, a builtin:tiny
server and client nodes as processes on loopback) driven by `jetctl.run.chaos.ChaosRun`."""

from __future__ import annotations

import os
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from jetctl.controller.runtimes.process import ProcessRuntime
from jetctl.run.chaos import ChaosRun
from jetctl.run.ledger import Ledger

ROOT = Path(__file__).resolve().parents[2]

# small numbers: a step every few groups, a checkpoint every 5 steps, fast restarts
RECIPE = """
run:
  name: faults
  restart_backoff_s: 0.5
models:
  policy:
    model: builtin:tiny
    finetune: full
    optimizer: {{lr: 2.0e-3}}
    train: {{groups_per_step: 2, max_staleness: 4}}
    checkpoint: {{every_steps: 5}}
tasks:
  digits:
    env: envs.digits:make_env
    agent: {agent}
    model: policy
    clients: {clients}
    group_size: 4
    concurrency: 4
    rollout_timeout_s: {rollout_timeout_s}
    inference: {inference}
    spool_max_bytes: {spool_max_bytes}
    sampling: {{max_tokens: 4}}
"""


def recipe_text(
    agent: str = "agents.noisy:agent", clients: int = 2, rollout_timeout_s: float = 30.0,
    inference: str = "server", spool_max_bytes: int = 64 * 1024 * 1024,
) -> str:
    return RECIPE.format(agent=agent, clients=clients, rollout_timeout_s=rollout_timeout_s,
                         inference=inference, spool_max_bytes=spool_max_bytes)


@pytest.fixture
def chaos_run(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[Callable[..., ChaosRun]]:
    """make(**recipe_args) -> a started ChaosRun; everything is stopped afterwards."""
    monkeypatch.chdir(ROOT)  # nodes import envs/ and agents/ from the repository root
    monkeypatch.setenv("PYTHONPATH", f"{ROOT}{os.pathsep}{os.environ.get('PYTHONPATH', '')}")
    runs: list[ChaosRun] = []

    def make(**recipe_args: object) -> ChaosRun:
        path = tmp_path / "recipe.yaml"
        path.write_text(recipe_text(**recipe_args))  # type: ignore[arg-type]
        run = ChaosRun(path, tmp_path / "run", grace_s=20.0, say=print)
        runs.append(run)
        run.start()
        return run

    yield make
    for run in runs:
        run.close()
        rt = ProcessRuntime(run.run_dir)
        for h in rt.list():  # whatever a failing test left behind
            rt.kill(h)


def assert_nothing_lost(ledger: Ledger) -> None:
    """Every acked id is trained, refused with a reason or still in flight; none trained
    twice; no id in two places (the ledger's balance)."""
    print(ledger.render())
    s = ledger.summary()
    assert s["lost"] == 0, s["problems"]
    assert s["trained_twice"] == 0, s["problems"]
    assert ledger.balanced, s["problems"]
    assert s["trained"] > 0, s
