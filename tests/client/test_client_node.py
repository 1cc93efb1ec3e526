"""A client node against a fake swarm server: groups arrive with the right fields, crashes and
timeouts become data, STALE is final, SIGTERM drains."""

from __future__ import annotations

import asyncio
import json
import os
import re
import signal
import sys
import time
from pathlib import Path
from typing import Any

import pytest

from jetctl.client.node import ClientNode, NodeConfig
from jetctl.client.spool import Spool
from jetctl.proto._gen import swarm_pb2 as pb
from jetctl.recipe import TaskConfig
from tests.client.client_fakes import TOKEN, FakeSwarm, start_fake_server
from tests.factories import parsed_recipe

pytestmark = pytest.mark.integration

REPO = Path(__file__).resolve().parents[2]
FAKES = "tests.client.client_fakes"


def digit_reply(tokenizer: Any) -> Any:
    """Generate answers the digit the prompt asks for, four times (reward 1.0)."""

    def reply(prompt_ids: list[int]) -> str:
        found = re.findall(r"\d", tokenizer.decode(prompt_ids))
        return (found[-1] if found else "0") * 4

    return reply


def parsed_task(**task: Any) -> TaskConfig:
    """A task whose block is `task` (the fake env unless it names another), parsed from a
    recipe as `jetctl up` parses it: what a node gets from the recipe's YAML."""
    return parsed_recipe(tasks={"digits": {"env": f"{FAKES}:make_env", **task}}).tasks["digits"]


async def run_node(tmp_path: Path, fake: FakeSwarm, max_groups: int, **task: Any) -> ClientNode:
    server, _ = await start_fake_server(fake, tmp_path)
    cfg = parsed_task(**{"concurrency": 4, **task})
    node = ClientNode(
        NodeConfig(
            name="t-0",
            task_name="echo",
            task=cfg,
            run_dir=tmp_path,
            token=TOKEN,
            revision="r7",
            max_groups=max_groups,
            install_signal_handlers=False,
            drain_grace_s=10,
        )
    )
    try:
        assert await node.run() == 0
    finally:
        await server.stop(None)
    return node


def status_file(tmp_path: Path) -> dict[str, Any]:
    return json.loads((tmp_path / "nodes" / "t-0.json").read_text())


@pytest.mark.timeout(120)
async def test_digits_groups_arrive_with_correct_fields(
    tokenizer: Any, tokenizer_files: dict[str, bytes], tmp_path: Path
) -> None:
    fake = FakeSwarm(tokenizer, tokenizer_files, reply_text=digit_reply(tokenizer))
    node = await run_node(
        tmp_path,
        fake,
        2,
        env="envs.digits:make_env",
        agent="agents.digits:agent",
        env_args={"digit": 7, "length": 4},
        group_size=2,
    )
    assert len(fake.stored) == 2
    for group in fake.stored.values():
        assert (
            group.task == "echo"
            and group.model == "policy"
            and group.task_id.startswith("digits-7-")
        )
        assert len(group.trajectories) == 2
        for t in group.trajectories:
            assert t.group_id == group.id and t.task_id == group.task_id and t.client_id == "t-0"
            assert t.client_revision == "r7" and t.role == "default" and t.status == "ok"
            assert t.reward == pytest.approx(1.0) and len(t.calls) == 1
            assert (
                t.calls[0].model_version == 0 and len(t.calls[0].completion_ids) == 4
            )  # max_tokens=length
            assert t.timings["rollout_s"] > 0
    ids = [t.id for g in fake.stored.values() for t in g.trajectories]
    assert len(set(ids)) == 4 and all(i[14] == "7" for i in ids)  # uuid7
    status = status_file(tmp_path)
    assert (
        status["state"] == "exited"
        and status["rollouts_done"] == 4
        and status["acks"] == {"accepted": 2}
    )
    assert status["spool_depth"] == 0 and fake.registers[0].client_revision == "r7"
    assert (
        node.metrics.registry.get_sample_value(
            "jetctl_client_rollouts_total", {"task": "echo", "outcome": "ok"}
        )
        == 4
    )


@pytest.mark.timeout(120)
async def test_crash_becomes_failed_record_and_node_continues(
    tokenizer: Any, tokenizer_files: dict[str, bytes], tmp_path: Path
) -> None:
    fake = FakeSwarm(tokenizer, tokenizer_files, reply_text=digit_reply(tokenizer))
    node = await run_node(
        tmp_path,
        fake,
        2,
        agent=f"{FAKES}:crash_once_agent",
        env_args={"workdir": str(tmp_path)},
        group_size=3,
        concurrency=3,
    )
    sizes = sorted(len(g.trajectories) for g in fake.stored.values())
    assert sizes == [2, 3]  # the crash cost one trajectory; both groups still went out
    dropped = Spool(tmp_path / "spool" / "t-0.sqlite").dropped_rows()
    assert len(dropped) == 1 and dropped[0][1] == "failed"
    assert "ZeroDivisionError: deliberate crash" in dropped[0][2] and "Traceback" in dropped[0][2]
    assert node.stats.rollouts_failed == 1 and node.stats.rollouts_done == 5
    assert status_file(tmp_path)["dropped"] == {"failed": 1}


@pytest.mark.timeout(120)
async def test_hanging_rollout_is_killed_with_its_children(
    tokenizer: Any, tokenizer_files: dict[str, bytes], tmp_path: Path
) -> None:
    fake = FakeSwarm(tokenizer, tokenizer_files)
    t0 = time.monotonic()
    node = await run_node(
        tmp_path,
        fake,
        1,
        agent=f"{FAKES}:hang_agent",
        env_args={"workdir": str(tmp_path)},
        group_size=2,
        rollout_timeout_s=3.0,
    )
    assert time.monotonic() - t0 < 40
    assert node.stats.rollouts_timeout == 2 and not fake.stored  # group dropped whole
    reasons = sorted(r[1] for r in Spool(tmp_path / "spool" / "t-0.sqlite").dropped_rows())
    assert reasons == ["timeout", "timeout"]
    children = [int(p.name.split("-")[1]) for p in tmp_path.glob("child-*")]
    assert len(children) == 2
    deadline = time.monotonic() + 5
    while any(_alive(pid) for pid in children) and time.monotonic() < deadline:
        await asyncio.sleep(0.1)
    assert not any(_alive(pid) for pid in children)


def _alive(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().split(")")[-1].split()[0]
    except FileNotFoundError:
        return False
    return state != "Z"


@pytest.mark.timeout(120)
async def test_stale_ack_is_final_and_async_agent_works(
    tokenizer: Any, tokenizer_files: dict[str, bytes], tmp_path: Path
) -> None:
    fake = FakeSwarm(tokenizer, tokenizer_files, ack_code=lambda _g: pb.Ack.STALE)
    node = await run_node(tmp_path, fake, 1, agent=f"{FAKES}:async_agent", group_size=2)
    assert len(fake.submit_calls) == 1  # never resent
    spool = Spool(tmp_path / "spool" / "t-0.sqlite")
    (gid,) = fake.submit_calls[0]
    assert spool.depth() == 0 and spool.outcome(gid) == ("stale", "fake refusal")
    assert node.stats.acks == {"stale": 1}


@pytest.mark.timeout(120)
async def test_sigterm_drains_and_exits_zero(
    tokenizer: Any, tokenizer_files: dict[str, bytes], tmp_path: Path
) -> None:
    fake = FakeSwarm(tokenizer, tokenizer_files)
    server, _ = await start_fake_server(fake, tmp_path)
    recipe = tmp_path / "recipe.yaml"
    recipe.write_text(
        "models:\n  policy:\n    model: builtin:tiny\n"
        f"tasks:\n  echo:\n    env: {FAKES}:make_env\n    agent: {FAKES}:slow_agent\n"
        "    model: policy\n    group_size: 2\n    concurrency: 2\n"
    )
    env = {**os.environ, "JETCTL_TOKEN": TOKEN, "PYTHONPATH": str(REPO)}
    proc = await asyncio.create_subprocess_exec(
        sys.executable,
        "-m",
        "jetctl.cli.main",
        "client",
        "--recipe",
        str(recipe),
        "--task",
        "echo",
        "--index",
        "0",
        "--run-dir",
        str(tmp_path),
        "--revision",
        "r0",
        "--drain-grace-s",
        "15",
        env=env,
    )
    try:
        deadline = time.monotonic() + 60
        while not fake.generate_calls and time.monotonic() < deadline:
            await asyncio.sleep(0.1)
        assert fake.generate_calls, "the node never generated"
        proc.send_signal(signal.SIGTERM)
        assert await asyncio.wait_for(proc.wait(), timeout=40) == 0
    finally:
        if proc.returncode is None:
            proc.kill()
        await server.stop(None)
    status = json.loads((tmp_path / "nodes" / "echo-0.json").read_text())
    assert status["state"] == "exited" and status["spool_depth"] == 0
    # the in-flight group finished and was delivered before exit
    assert status["groups_spooled"] >= 1 and len(fake.stored) == status["groups_spooled"]


@pytest.mark.timeout(120)
async def test_backpressure_stops_new_rollouts_and_keeps_unacked_groups(
    tokenizer: Any, tokenizer_files: dict[str, bytes], tmp_path: Path
) -> None:
    fake = FakeSwarm(
        tokenizer,
        tokenizer_files,
        reply_text=lambda _p: "7 " * 100,
        submit_faults=["unavailable"] * 1000,
    )
    server, _ = await start_fake_server(fake, tmp_path)
    cfg = parsed_task(
        agent=f"{FAKES}:async_agent",
        group_size=2,
        concurrency=2,
        spool_max_bytes=1024,
        env_args={"max_tokens": 200},
    )
    node = ClientNode(
        NodeConfig(
            name="t-0",
            task_name="echo",
            task=cfg,
            run_dir=tmp_path,
            token=TOKEN,
            max_groups=20,
            install_signal_handlers=False,
            drain_grace_s=1,
        )
    )
    run = asyncio.create_task(node.run())
    deadline = time.monotonic() + 60
    while node.stats.groups_spooled == 0 and time.monotonic() < deadline:
        await asyncio.sleep(0.1)
    await asyncio.sleep(3.0)  # rollouts would finish several more groups in this time
    spooled = node.stats.groups_spooled
    # only groups already started before the first one was spooled may land; none after
    assert 1 <= spooled <= 2 and node.stats.groups_finished == spooled
    node.drain()
    assert await asyncio.wait_for(run, timeout=30) == 0
    await server.stop(None)
    spool = Spool(tmp_path / "spool" / "t-0.sqlite")
    assert spool.depth() == spooled and spool.bytes() > 1024  # un-acked groups kept, none lost
    assert status_file(tmp_path)["server_reachable"] is False


@pytest.mark.timeout(120)
async def test_the_tasks_sampling_and_seed_reach_the_model(
    tokenizer: Any, tokenizer_files: dict[str, bytes], tmp_path: Path
) -> None:
    """`sampling:` fills the knobs a request leaves out; `seed` (+ the node's index) seeds
    the env's task stream."""
    import collections
    import random

    fake = FakeSwarm(tokenizer, tokenizer_files, reply_text=digit_reply(tokenizer))
    await run_node(
        tmp_path, fake, 3, agent=f"{FAKES}:bare_agent", group_size=2, concurrency=2, seed=5,
        sampling={"temperature": 0.5, "top_p": 0.8, "max_tokens": 3},
    )
    assert len(fake.generate_calls) == 6
    for req in fake.generate_calls:
        assert (req.temperature, req.top_p, req.max_tokens) == (
            pytest.approx(0.5), pytest.approx(0.8), 3
        )
    rng = random.Random(5)  # the echo env draws one digit per task
    drawn = [f"echo-{rng.randrange(10)}" for _ in range(3)]
    stored = [g.task_id for g in fake.stored.values()]
    assert collections.Counter(stored) == collections.Counter(drawn)


@pytest.mark.timeout(120)
@pytest.mark.parametrize("concurrency", [2, 4])
async def test_concurrency_bounds_the_rollouts_running_at_once(
    tokenizer: Any, tokenizer_files: dict[str, bytes], tmp_path: Path, concurrency: int
) -> None:
    fake = FakeSwarm(tokenizer, tokenizer_files)
    await run_node(
        tmp_path, fake, 4, agent=f"{FAKES}:overlap_agent", env_args={"workdir": str(tmp_path)},
        group_size=2, concurrency=concurrency,
    )
    peaks = [int(p.read_text()) for p in tmp_path.glob("peak-*")]
    assert len(peaks) == 8
    assert max(peaks) == concurrency  # groups queue for the slots; never more run at once


@pytest.mark.timeout(120)
async def test_a_sender_error_is_logged_counted_and_delivery_goes_on(
    tokenizer: Any, tokenizer_files: dict[str, bytes], tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture,
) -> None:
    # a spool locked past its timeout under load once left a restarted node spooling
    # thousands of groups and sending none, while its status looked healthy
    import sqlite3

    real_due = Spool.due
    failures = {"left": 2}

    def flaky_due(self: Spool, *args: Any, **kwargs: Any) -> Any:
        if failures["left"] > 0:
            failures["left"] -= 1
            raise sqlite3.OperationalError("database is locked")
        return real_due(self, *args, **kwargs)

    monkeypatch.setattr(Spool, "due", flaky_due)
    fake = FakeSwarm(tokenizer, tokenizer_files, reply_text=digit_reply(tokenizer))
    node = await run_node(
        tmp_path, fake, 2, env="envs.digits:make_env", agent="agents.digits:agent",
        env_args={"digit": 7, "length": 4}, group_size=2,
    )
    assert failures["left"] == 0
    assert len(fake.stored) == 2, "every group was delivered after the errors"
    assert status_file(tmp_path)["spool_depth"] == 0
    assert node.metrics.registry.get_sample_value("jetctl_client_delivery_errors_total") == 2
    assert "database is locked" in caplog.text


@pytest.mark.timeout(120)
async def test_groups_of_an_earlier_process_go_out_while_the_node_registers(
    tokenizer: Any, tokenizer_files: dict[str, bytes], tmp_path: Path
) -> None:
    # a node killed with groups still spooled: its next process sends them before it
    # registers. Registering reopened the channel under that Submit, the Submit was
    # cancelled and the sender ended; the node then spooled thousands of groups, sent none
    # and looked healthy (a chaos test timed out waiting for the version to rise)
    from jetctl.client.spool import SpooledGroup
    from jetctl.proto.convert import group_to_pb
    from jetctl.rundir import RunPaths
    from tests.factories import make_group

    leftover = [make_group() for _ in range(3)]
    spool = Spool(RunPaths(tmp_path).spool("t-0"))
    spool.put_all([
        SpooledGroup(g.id, group_to_pb(g).SerializeToString(), [t.id for t in g.trajectories],
                     "policy")
        for g in leftover
    ])
    spool.close()
    fake = FakeSwarm(tokenizer, tokenizer_files, reply_text=digit_reply(tokenizer),
                     submit_delay_s=0.5)
    await run_node(
        tmp_path, fake, 2, env="envs.digits:make_env", agent="agents.digits:agent",
        env_args={"digit": 7, "length": 4}, group_size=2,
    )
    assert {g.id for g in leftover} <= set(fake.stored), "the earlier process's groups arrived"
    assert len(fake.stored) == 3 + 2, "and the groups of this one"
    assert status_file(tmp_path)["spool_depth"] == 0
