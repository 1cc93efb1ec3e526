"""The waste a node tallies is whole (jetctl/costs.py): a rollout killed for its timeout, or
one that died without a result, keeps the spend it reported as it ran; a group whose node
task raised counts what its rollouts reported; a group the server refused at Submit counts
its trajectories' costs; and a node restarted under the same name goes on from its tally.

Real rollout processes, a real node against a fake swarm server over real gRPC, and a real
sqlite spool; the group that raised uses a fake runner (no processes)."""

from __future__ import annotations

import asyncio
import os
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

from jetctl.client.metrics import ClientMetrics, NodeStats
from jetctl.client.production import Producer, ProductionConfig
from jetctl.client.rollout import Reported, RolloutResult, RolloutRunner, RolloutSpec
from jetctl.client.spool import Spool
from jetctl.client.transport import Delivery, SwarmTransport
from jetctl.costs import NodeWaste, client_waste
from jetctl.env import Spending, Task
from jetctl.proto._gen import swarm_pb2 as pb
from jetctl.proto.convert import group_to_pb
from jetctl.recipe import TaskConfig
from jetctl.rundir import RunPaths
from tests.client.client_fakes import TOKEN, EchoEnv, EchoSession, FakeSwarm, start_fake_server
from tests.client.test_client_node import run_node, status_file
from tests.client.test_client_production import FakeProxy
from tests.factories import make_group

HERE = "tests.client.test_client_waste_whole"
PRICE = 0.25  # dollars a rollout's judge costs: exact in binary, so the sums are exact


@dataclass
class PaidSession(EchoSession, Spending):
    pass


@dataclass
class PaidEnv(EchoEnv):
    def open(self, task: Task) -> PaidSession:
        return PaidSession(task, self.workdir, self.max_tokens)


def make_env(workdir: str = "", max_tokens: int = 8) -> PaidEnv:
    return PaidEnv(workdir, max_tokens)


def paid_hang_agent(task: Task, llm: object, session: PaidSession) -> None:
    """Pays the judge, then never returns: killed for its timeout."""
    session.cost(usd=PRICE, kind="judge")
    time.sleep(10_000)


def paid_exit_agent(task: Task, llm: object, session: PaidSession) -> None:
    """Pays the judge twice, then its process dies without a result."""
    session.cost(usd=PRICE, kind="judge")
    session.cost(usd=PRICE, kind="sandbox")
    os._exit(3)


@pytest.mark.integration
@pytest.mark.timeout(60)
async def test_a_rollout_process_that_dies_without_a_result_keeps_the_spend_it_reported(
) -> None:
    runner = RolloutRunner(preload=[HERE], max_workers=1)
    reported = Reported()
    try:
        result = await runner.run(RolloutSpec(
            env=f"{HERE}:make_env", env_args={}, agent=f"{HERE}:paid_exit_agent",
            task=Task(id="t", prompt="", data={"digit": "1"}),
            base_url="http://127.0.0.1:9/v1", model="policy",
        ), timeout_s=30, reported=reported)
    finally:
        runner.shutdown()
    assert result.status == "failed" and result.error_type == "RolloutProcessDied", result.error
    assert result.usd == {"judge": PRICE, "sandbox": PRICE}
    assert "open_s" in result.timings and result.timings["rollout_s"] > 0
    assert reported.usd == result.usd and reported.timings == result.timings  # the caller's


@pytest.mark.integration
@pytest.mark.timeout(120)
async def test_a_timed_out_rollouts_spend_is_waste_and_a_restarted_node_keeps_its_tally(
    tokenizer: Any, tokenizer_files: dict[str, bytes], tmp_path: Path
) -> None:
    task: dict[str, Any] = {"env": f"{HERE}:make_env", "agent": f"{HERE}:paid_hang_agent",
                            "group_size": 2, "rollout_timeout_s": 2.0}
    node = await run_node(tmp_path, FakeSwarm(tokenizer, tokenizer_files), 1, **task)
    assert node.stats.rollouts_timeout == 2
    waste = status_file(tmp_path)["waste"]
    # both rollouts paid the judge before they were killed: their spend is the task's waste
    assert waste["trajectories"] == 2.0 and waste["usd/judge"] == 2 * PRICE
    assert waste["rollout_s"] >= 2 * 2.0 and waste["env_s"] >= 0  # their env's open, timed
    assert "client_cpu_s" not in waste, "a killed process's CPU seconds are unknown"

    # the same node again (a restart): its tally goes on from the last one's
    await run_node(tmp_path, FakeSwarm(tokenizer, tokenizer_files), 1, **task)
    again = status_file(tmp_path)["waste"]
    assert again["trajectories"] == 4.0 and again["usd/judge"] == 4 * PRICE
    # the run's summary sums the nodes' last statuses: the first process's waste is in it
    assert client_waste([status_file(tmp_path)])["echo"]["usd/judge"] == 4 * PRICE


class RaisingRunner:
    """A group's first rollout reports spend (as a real rollout process does after its
    session opens and pays), then runs on until it is cancelled; its sibling's process
    cannot start (what a dead forkserver raises), so the group's task raises."""

    def __init__(self) -> None:
        self.calls = 0

    async def run(self, spec: RolloutSpec, timeout_s: float,
                  reported: Reported | None = None, held: object = None) -> RolloutResult:
        assert reported is not None
        call, self.calls = self.calls, self.calls + 1
        if call == 1:
            await asyncio.sleep(0.05)
            raise EOFError("unexpected EOF")
        reported.update({"judge": PRICE}, {"open_s": 0.5})
        try:
            await asyncio.sleep(30)
        except asyncio.CancelledError:
            reported.timings["rollout_s"] = 1.0  # the real runner notes its wall seconds
            raise
        raise AssertionError("cancelled with its group")


@pytest.mark.unit
@pytest.mark.timeout(30)
async def test_a_group_whose_task_raised_counts_what_its_rollouts_reported_as_waste(
    tmp_path: Path,
) -> None:
    task = TaskConfig(model="policy", env=f"{HERE}:make_env", agent=f"{HERE}:paid_hang_agent",
                      group_size=2, concurrency=2)
    paths = RunPaths(tmp_path)
    spool = Spool(paths.spool("t-0"))
    producer = Producer(
        ProductionConfig(node="t-0", task_name="echo", task=task, agent=task.agent,
                         revision="r0", max_groups=1),
        FakeProxy(), RaisingRunner(), spool, NodeStats(), ClientMetrics(),  # type: ignore[arg-type]
        draining=asyncio.Event(), on_spooled=lambda: None,
        waste=NodeWaste(spool),
    )
    await producer.run()
    assert [reason for _, reason, _ in spool.dropped_rows()] == ["failed", "failed"]
    spool.close()
    # the rollout that could not start reported nothing; the other paid before it was stopped
    expected = {"trajectories": 2.0, "usd/judge": PRICE, "env_s": 0.5, "rollout_s": 1.0}
    assert producer.waste.totals == expected
    assert NodeWaste(Spool(paths.spool("t-0"))).totals == expected  # what a restart reads back


@pytest.mark.integration
@pytest.mark.timeout(60)
@pytest.mark.parametrize("code", [pb.Ack.STALE, pb.Ack.INVALID, pb.Ack.REVISION])
async def test_a_group_refused_at_submit_adds_its_trajectories_to_the_waste(
    tokenizer: Any, tokenizer_files: dict[str, bytes], tmp_path: Path, code: int
) -> None:
    refused, accepted = make_group(rewards=(0.0, 1.0) * 4), make_group(rewards=(0.0, 1.0))
    for t in refused.trajectories + accepted.trajectories:
        t.costs = {"usd/judge": PRICE, "client_cpu_s": 0.5, "env_s": 0.25}
        t.timings = {"rollout_s": 2.0}
    fake = FakeSwarm(tokenizer, tokenizer_files,
                     ack_code=lambda g: code if g.id == refused.id else pb.Ack.ACCEPTED)
    server, _ = await start_fake_server(fake, tmp_path)
    paths = RunPaths(tmp_path)
    spool = Spool(paths.spool("t-0"))
    for g in (refused, accepted):
        spool.put(g.id, group_to_pb(g).SerializeToString(), len(g.trajectories),
                  trajectory_ids=[t.id for t in g.trajectories])
    transport = SwarmTransport("policy", TOKEN, run_dir=tmp_path)
    delivery = Delivery(spool, transport, NodeStats(), ClientMetrics(),
                        waste=NodeWaste(spool))
    sender = asyncio.create_task(delivery.run())
    try:
        await delivery.flush(20)
    finally:
        delivery.stop()
        await sender
        await transport.close()
        await server.stop(None)
    assert spool.depth() == 0 and list(fake.stored) == [accepted.id]
    spool.close()
    # the refused group's 8 trajectories, and nothing of the accepted one
    expected = {"trajectories": 8.0, "usd/judge": 8 * PRICE, "client_cpu_s": 8 * 0.5,
                "env_s": 8 * 0.25, "rollout_s": 8 * 2.0}
    assert delivery.waste.totals == expected
    assert NodeWaste(Spool(paths.spool("t-0"))).totals == expected
