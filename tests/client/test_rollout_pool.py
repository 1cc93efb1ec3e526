"""A rollout that breaks the node's forkserver costs that rollout at most: the next starts
rebuild the pool and run (issue 25: under a container's pids limit a fork bomb killed the
forkserver, and the node dropped every group it started until the dead server was reaped).
No docker: the forkserver's fork is made to fail as the pids limit makes it fail."""

from __future__ import annotations

import asyncio
import os
from collections.abc import Iterator
from multiprocessing import forkserver
from pathlib import Path

import pytest

from jetctl.client.rollout import RolloutRunner, RolloutSpec, stop_forkserver
from jetctl.env import Task
from tests.client.pool_faults import FLAG_ENV

pytestmark = pytest.mark.integration


@pytest.fixture
def fault_flag(tmp_path: Path) -> Iterator[Path]:
    """A forkserver of this test's own (with pool_faults preloaded), the flag that breaks it."""
    flag = tmp_path / "fail-next-fork"
    stop_forkserver()  # another test's forkserver lacks the fault module
    os.environ[FLAG_ENV] = str(flag)
    try:
        yield flag
    finally:
        del os.environ[FLAG_ENV]
        stop_forkserver()


def _spec(agent: str) -> RolloutSpec:
    return RolloutSpec(
        env="tests.client.pool_faults:make_env", env_args={},
        agent=f"tests.client.pool_faults:{agent}", task=Task(id="t", prompt=""),
        base_url="http://127.0.0.1:9/v1", model="policy",
    )


@pytest.mark.timeout(60)
async def test_a_forkserver_killed_by_a_failed_fork_is_rebuilt_and_no_rollout_is_lost(
    fault_flag: Path,
) -> None:
    runner = RolloutRunner(preload=["tests.client.pool_faults"], max_workers=4)
    try:
        first = await runner.run(_spec("bomb_agent"), timeout_s=30)
        assert first.status == "ok", first.error
        assert fault_flag.exists(), "the agent left the forkserver unable to fork"
        server_before = forkserver._forkserver._forkserver_pid  # type: ignore[attr-defined]
        # four rollouts start at once on the broken forkserver: its fork fails, it dies
        results = await asyncio.gather(*(runner.run(_spec("calm_agent"), 30) for _ in range(4)))
        assert [r.status for r in results] == ["ok"] * 4, [r.error for r in results]
        assert not fault_flag.exists(), "the fault fired: the forkserver's fork failed"
        assert runner.pool_rebuilds >= 1
        server_after = forkserver._forkserver._forkserver_pid  # type: ignore[attr-defined]
        assert server_after not in (None, server_before), "a fresh forkserver serves now"
        # and the node goes on as before
        again = await asyncio.gather(*(runner.run(_spec("calm_agent"), 30) for _ in range(3)))
        assert [r.status for r in again] == ["ok"] * 3
    finally:
        runner.shutdown()


@pytest.mark.timeout(60)
async def test_soft_preloads_load_once_and_a_broken_one_breaks_nothing() -> None:
    """A node's soft preloads (the `module:attr` of its env_args, a dataset task's reward)
    are loaded in the forkserver, so a rollout inherits them; one that raises at import
    leaves the forkserver serving. `named_modules` picks them from env_args."""
    from jetctl.client.node import named_modules

    assert named_modules({"reward": "tests.client.soft_preload:LOADED", "data": "rows.jsonl",
                          "url": "http://host:80", "n": 3}) == ["tests.client.soft_preload"]
    stop_forkserver()  # another test's forkserver was started without these
    runner = RolloutRunner(
        preload=["tests.client.pool_faults"], max_workers=2,
        soft_preload=["tests.client.soft_preload_broken", "tests.client.soft_preload"],
    )
    try:
        results = await asyncio.gather(*(runner.run(_spec("preloaded_agent"), 30)
                                         for _ in range(2)))
        assert [r.status for r in results] == ["ok", "ok"], [r.error for r in results]
        assert runner.pool_rebuilds == 0
    finally:
        runner.shutdown()
        stop_forkserver()
