"""concurrency: auto: the governor's decisions from the server's Load, and a node that moves
its rollout limit by what a (fake) server's Generate replies say."""

from __future__ import annotations

import asyncio
import time
from pathlib import Path
from typing import Any

import pytest

from jetctl.client.concurrency import MAX_GROUPS, START, Governor, Slots
from jetctl.client.node import ClientNode, NodeConfig
from jetctl.proto._gen import swarm_pb2 as pb
from jetctl.recipe import TaskConfig
from tests.client.client_fakes import TOKEN, FakeSwarm, start_fake_server

G = 8
WAITING = pb.Load(engine_rows=3, engine_max_rows=16, engine_queued=0, buffer_groups=0,
                  groups_per_step=2)
FULL = pb.Load(engine_rows=16, engine_max_rows=16, engine_queued=6, buffer_groups=0,
               groups_per_step=2)
BACKLOG = pb.Load(engine_rows=8, engine_max_rows=16, engine_queued=0, buffer_groups=9,
                  groups_per_step=2)


class Clock:
    def __init__(self) -> None:
        self.t = 0.0

    def __call__(self) -> float:
        return self.t


def governor() -> tuple[Governor, Clock]:
    clock = Clock()
    return Governor(G, start=START, interval_s=3.0, clock=clock), clock


def look(gov: Governor, clock: Clock, load: pb.Load, peak: int) -> Any:
    for _ in range(5):
        gov.observe(load)
    clock.t += 3.0
    return gov.decide(peak)


@pytest.mark.unit
def test_a_waiting_trainer_and_busy_slots_raise_the_limit_by_a_group_up_to_the_ceiling() -> None:
    gov, clock = governor()
    assert gov.limit == START
    d = look(gov, clock, WAITING, peak=gov.limit)
    assert (d.limit, d.why) == (START + G, "trainer waits for groups; engine has room")
    while gov.limit < MAX_GROUPS * G:
        look(gov, clock, WAITING, peak=gov.limit)
    d = look(gov, clock, WAITING, peak=gov.limit)
    assert d.limit == MAX_GROUPS * G and d.why.endswith("(at the ceiling)")


@pytest.mark.unit
def test_slots_left_idle_hold_the_limit_even_when_the_trainer_waits() -> None:
    gov, clock = governor()
    d = look(gov, clock, WAITING, peak=gov.limit - 1)  # the node could not fill its slots
    assert (d.limit, d.why) == (START, "steady")


@pytest.mark.unit
def test_a_full_engine_or_a_trainer_backlog_lower_it_to_one_group() -> None:
    gov, clock = governor()
    look(gov, clock, WAITING, peak=gov.limit)
    look(gov, clock, WAITING, peak=gov.limit)
    assert gov.limit == START + 2 * G
    d = look(gov, clock, FULL, peak=gov.limit)
    assert d.limit == START + G and d.why.startswith("engine full (6.0 requests waiting")
    d = look(gov, clock, BACKLOG, peak=gov.limit)
    assert d.limit == START and d.why == "trainer has a backlog (9 groups buffered)"
    d = look(gov, clock, FULL, peak=gov.limit)
    assert d.limit == G and d.why.endswith("(at the floor)")


@pytest.mark.unit
def test_no_decision_before_the_interval_or_without_replies() -> None:
    gov, clock = governor()
    gov.observe(FULL)
    clock.t += 1.0
    assert gov.decide(gov.limit) is None  # too soon
    clock.t += 2.0
    assert gov.decide(gov.limit) is not None
    clock.t += 3.0
    assert gov.decide(gov.limit) is None  # nothing observed since


@pytest.mark.unit
async def test_slots_admit_up_to_the_limit_and_more_once_it_is_raised() -> None:
    slots = Slots(2)
    held = [asyncio.create_task(slots.__aenter__()) for _ in range(3)]
    await asyncio.sleep(0.05)
    assert sum(t.done() for t in held) == 2 and slots.peak() == 2
    await slots.resize(3)
    await asyncio.wait_for(asyncio.gather(*held), 5)
    assert slots.used == 3
    await slots.__aexit__(None, None, None)
    assert slots.peak() == 3 and slots.peak() == 2  # the peak resets to those in use


async def _limit_after(tmp_path: Path, tokenizer: Any, files: dict[str, bytes],
                       load: pb.Load, seconds: float) -> dict[str, Any]:
    fake = FakeSwarm(tokenizer, files, load=load)
    server, _ = await start_fake_server(fake, tmp_path)
    cfg = TaskConfig(
        model="policy", env="jetctl.bench.latency:make_env", agent="agents.digits:agent",
        env_args={"inner": "envs.digits:make_env", "latency_s": 0.5,
                  "inner_args": {"digit": 7, "length": 4}},
        group_size=4,
    )
    assert cfg.concurrency == "auto"
    node = ClientNode(NodeConfig(
        name="t-0", task_name="digits", task=cfg, run_dir=tmp_path, token=TOKEN,
        install_signal_handlers=False, drain_grace_s=5,
    ))
    run = asyncio.create_task(node.run())
    whys: list[str] = []  # every reason the governor gave, in order (the last may be steady)
    try:
        deadline = time.monotonic() + seconds
        while time.monotonic() < deadline:
            await asyncio.sleep(0.2)
            why = node.status()["concurrency_why"]
            if not whys or whys[-1] != why:
                whys.append(why)
        status = {**node.status(), "whys": whys}
    finally:
        node.drain()
        assert await asyncio.wait_for(run, timeout=60) == 0
        await server.stop(None)
    return status


@pytest.mark.integration
@pytest.mark.timeout(120)
async def test_a_node_with_a_slow_env_runs_more_rollouts_while_the_server_says_it_waits(
    tokenizer: Any, tokenizer_files: dict[str, bytes], tmp_path: Path
) -> None:
    status = await _limit_after(tmp_path, tokenizer, tokenizer_files, WAITING, seconds=14)
    assert status["concurrency"] > START, status
    # raised for that reason (once the rollouts no longer fill the new limit in a window, a
    # look says "steady": a loaded machine's CI run read that at the end)
    assert "trainer waits for groups; engine has room" in status["whys"], status


@pytest.mark.integration
@pytest.mark.timeout(120)
async def test_a_node_backs_off_to_one_group_while_the_engine_is_full(
    tokenizer: Any, tokenizer_files: dict[str, bytes], tmp_path: Path
) -> None:
    status = await _limit_after(tmp_path, tokenizer, tokenizer_files, FULL, seconds=10)
    assert status["concurrency"] == 4, status  # group_size: the floor
    assert status["concurrency_why"].startswith("engine full")
