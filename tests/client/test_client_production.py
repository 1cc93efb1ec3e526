"""Production's bookkeeping of a group whose task raised: its error is read, logged and
counted, and its trajectories leave `inflight` at once (a real sqlite spool; fake proxy and
runner, no processes)."""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest

from jetctl.client.metrics import ClientMetrics, NodeStats
from jetctl.client.production import Producer, ProductionConfig
from jetctl.client.rollout import RolloutResult, RolloutSpec
from jetctl.client.spool import Spool
from jetctl.client.timeline import Timeline, Turn
from jetctl.recipe import TaskConfig
from jetctl.run.ledger import ledger_from_files
from jetctl.rundir import RunPaths
from jetctl.types import LLMCall

pytestmark = pytest.mark.unit


class FakeProxy:
    """Timelines as the real proxy keeps them; each closed rollout made one call."""

    def __init__(self) -> None:
        self.timelines: dict[str, Timeline] = {}

    def open(self, rollout_id: str, seeds: object = None) -> Timeline:
        self.timelines[rollout_id] = Timeline(rollout_id)
        return self.timelines[rollout_id]

    def held_s(self, since: float) -> float:
        return 0.0  # served from the start: no call waits for a server

    def close(self, rollout_id: str) -> Timeline:
        timeline = self.timelines.pop(rollout_id)
        call = LLMCall("policy", [1, 2], [3], [-0.5], 0)
        timeline.turns.append(Turn([], "", "", {"role": "assistant", "content": "7"}, call, False))
        return timeline

    def base_url(self, rollout_id: str) -> str:
        return f"http://127.0.0.1:9/r/{rollout_id}/v1"


class FailingRunner:
    """Rollouts succeed, except the first of the `fail_group`-th group started: it raises
    what multiprocessing raises when the forkserver dies under a start (the node's process
    group got the SIGTERM of a `down`). Its sibling is still running then."""

    def __init__(self, fail_group: int) -> None:
        self.fail_call = 2 * fail_group  # group_size 2: the groups' rollouts start in order
        self.calls = 0
        self.cancelled = 0

    async def run(self, spec: RolloutSpec, timeout_s: float, reported: object = None,
                  held: object = None) -> RolloutResult:
        call, self.calls = self.calls, self.calls + 1
        if call == self.fail_call:
            await asyncio.sleep(0.05)
            raise EOFError("unexpected EOF")
        try:
            await asyncio.sleep(0.5 if call == self.fail_call + 1 else 0.01)
        except asyncio.CancelledError:
            self.cancelled += 1
            raise
        return RolloutResult("ok", reward=float(call % 2), timings={"rollout_s": 0.01})


@pytest.mark.timeout(30)
async def test_a_group_whose_task_raised_is_logged_counted_and_leaves_nothing_inflight(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    task = TaskConfig(
        model="policy", env="tests.client.client_fakes:make_env",
        agent="tests.client.client_fakes:async_agent", group_size=2, concurrency=4,
    )
    spool = Spool(RunPaths(tmp_path).spool("t-0"))
    stats, metrics, runner = NodeStats(), ClientMetrics(), FailingRunner(fail_group=1)
    producer = Producer(
        ProductionConfig(node="t-0", task_name="echo", task=task, agent=task.agent,
                         revision="r0", max_groups=3),
        FakeProxy(), runner, spool, stats, metrics,  # type: ignore[arg-type]
        draining=asyncio.Event(), on_spooled=lambda: None,
    )
    await producer.run()  # before the fix: EOFError out of run(), or silently forgotten

    assert spool.inflight() == 0, "nothing stays in progress once the producer returns"
    assert spool.depth() == 2, "the other two groups were spooled"
    dropped = spool.dropped_rows()
    assert [reason for _, reason, _ in dropped] == ["failed", "failed"], "the failed group's 2"
    assert all("EOFError: unexpected EOF" in error for _, _, error in dropped)
    assert runner.cancelled == 1, "the failed group's other rollout was stopped"
    assert metrics.registry.get_sample_value("jetctl_client_group_errors_total") == 1
    assert metrics.registry.get_sample_value(
        "jetctl_client_trajectories_dropped_total", {"reason": "failed"}
    ) == 2
    assert stats.dropped == {"failed": 2} and stats.groups_dropped == 1
    assert "EOFError: unexpected EOF" in caplog.text and "dropped(failed)" in caplog.text
    spool.close()

    ledger = ledger_from_files(tmp_path)  # no server yet: the spooled groups are in flight
    assert ledger.balanced and ledger.produced == 6
    assert ledger.dropped == {"failed": 2} and dict(ledger.in_flight) == {"client_spool": 4}
