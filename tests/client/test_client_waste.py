"""Waste in the cost ledger (jetctl/costs.py): what a node's trajectories that trained nothing
cost (failed, timed out, ok in a dropped group) is tallied in its status and summed per task
for the run; a rollout that fails after its session spent keeps that spend.

The unit tests use a real sqlite spool with a fake proxy and runner (no processes); the last
runs one real rollout process."""

from __future__ import annotations

import asyncio
from dataclasses import dataclass
from pathlib import Path

import pytest

from jetctl.client.metrics import ClientMetrics, NodeStats
from jetctl.client.production import Producer, ProductionConfig
from jetctl.client.rollout import RolloutResult, RolloutRunner, RolloutSpec
from jetctl.client.spool import Spool
from jetctl.costs import client_waste, waste_line
from jetctl.env import Spending, Task
from jetctl.recipe import TaskConfig
from jetctl.rundir import RunPaths
from tests.client.client_fakes import EchoEnv, EchoSession
from tests.client.test_client_production import FakeProxy

PRICE = 0.25  # dollars a rollout's judge costs: exact in binary, so the sums are exact

# what each rollout of the two groups (group_size 3) returns, in start order
OK = RolloutResult("ok", reward=1.0, timings={"cpu_s": 0.5, "open_s": 0.25, "rollout_s": 2.0},
                   usd={"judge": PRICE})
OK0 = RolloutResult("ok", reward=0.0, timings={"cpu_s": 0.5, "open_s": 0.25, "rollout_s": 2.0},
                    usd={"judge": PRICE})
FAILED = RolloutResult("failed", error="ZeroDivisionError", error_type="ZeroDivisionError",
                       timings={"cpu_s": 1.0, "open_s": 0.5, "rollout_s": 3.0},
                       usd={"judge": PRICE})
TIMEOUT = RolloutResult("timeout", error="killed", timings={"rollout_s": 8.0})
RESULTS = [OK, OK0, FAILED,  # group 0: spooled; its failed rollout is waste
           OK, TIMEOUT, FAILED]  # group 1: 1 ok of 3, dropped whole: all three are waste


class ScriptedRunner:
    """RESULTS in turn (no await: each rollout ends in the order they start)."""

    def __init__(self) -> None:
        self.calls = 0

    async def run(self, spec: RolloutSpec, timeout_s: float, reported: object = None,
                  held: object = None) -> RolloutResult:
        i, self.calls = self.calls, self.calls + 1
        return RESULTS[i]


@pytest.mark.unit
@pytest.mark.timeout(30)
async def test_a_nodes_failed_timed_out_and_dropped_trajectories_are_tallied_as_waste(
    tmp_path: Path,
) -> None:
    task = TaskConfig(
        model="policy", env="tests.client.client_fakes:make_env",
        agent="tests.client.client_fakes:async_agent", group_size=3, concurrency=3,
    )
    spool = Spool(RunPaths(tmp_path).spool("t-0"))
    producer = Producer(
        ProductionConfig(node="t-0", task_name="echo", task=task, agent=task.agent,
                         revision="r0", max_groups=2),
        FakeProxy(), ScriptedRunner(), spool, NodeStats(), ClientMetrics(),  # type: ignore[arg-type]
        draining=asyncio.Event(), on_spooled=lambda: None,
    )
    await producer.run()
    assert spool.depth() == 1 and len(spool.dropped_rows()) == 4  # the waste's trajectories
    spool.close()

    # by hand: group 0's FAILED; group 1's OK, TIMEOUT and FAILED (its one ok is dropped too)
    assert producer.waste.totals == {
        "trajectories": 4.0,
        "usd/judge": 3 * PRICE,  # the failed rollouts' spend; TIMEOUT reported none
        "client_cpu_s": 1.0 + 0.5 + 1.0,
        "env_s": 0.5 + 0.25 + 0.5,
        "rollout_s": 3.0 + 2.0 + 8.0 + 3.0,
    }

    # two nodes of the task and one of another, as their statuses report them
    statuses = [{"task": "echo", "waste": producer.waste.totals}, {"task": "echo", "waste": {}},
                {"task": "echo", "waste": {"trajectories": 1.0, "rollout_s": 1.0}},
                {"task": "other", "waste": {"trajectories": 2.0, "usd/api": 0.5}}]
    waste = client_waste(statuses)
    assert waste["echo"]["trajectories"] == 5.0 and waste["echo"]["rollout_s"] == 17.0
    assert waste["other"] == {"trajectories": 2.0, "usd/api": 0.5}
    line = waste_line("echo", waste["echo"])
    assert line == ("waste echo: 5 trajectories failed, timed out or dropped on the nodes, or "
                    "refused at Submit: client CPU 2.5 s, env 1.2 s, rollouts 17.0 s wall; env "
                    "spend $0.7500 (judge $0.7500)")


@dataclass
class PaidCrashSession(EchoSession, Spending):
    pass


@dataclass
class PaidCrashEnv(EchoEnv):
    def open(self, task: Task) -> PaidCrashSession:
        session = PaidCrashSession(task)
        session.cost(usd=PRICE, kind="judge")  # a sandbox paid for as it opens
        return session


def make_env() -> PaidCrashEnv:
    return PaidCrashEnv()


def crash_agent(task: Task, llm: object, session: PaidCrashSession) -> None:
    raise RuntimeError("the agent crashed after its session spent")


@pytest.mark.integration
@pytest.mark.timeout(60)
async def test_a_rollout_that_fails_after_its_session_spent_keeps_the_spend() -> None:
    runner = RolloutRunner(preload=["tests.client.test_client_waste"], max_workers=1)
    try:
        result = await runner.run(RolloutSpec(
            env="tests.client.test_client_waste:make_env", env_args={},
            agent="tests.client.test_client_waste:crash_agent",
            task=Task(id="t", prompt="", data={"digit": "1"}),
            base_url="http://127.0.0.1:9/v1", model="policy",
        ), timeout_s=30)
    finally:
        runner.shutdown()
    assert result.status == "failed" and result.error_type == "RuntimeError", result.error
    assert result.usd == {"judge": PRICE}
    assert {"cpu_s", "open_s"} <= set(result.timings)  # its CPU (ticks: may read 0) and env time
