"""A team task's node against two fake swarm servers, one per model: each role's calls reach
its own model's server, each role's part of a group goes to that server with the role's
reward, and one server's refusal stays that server's. A node of a run with a controller finds
each model's server through its control link (a fake Control service on real gRPC)."""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

import grpc
import pytest

from jetctl.client.node import ClientNode, NodeConfig
from jetctl.client.spool import Spool
from jetctl.link import ControlLink
from jetctl.proto._gen import control_pb2 as cpb
from jetctl.proto._gen import control_pb2_grpc as cpb_grpc
from jetctl.proto._gen import swarm_pb2 as pb
from jetctl.recipe import parse_recipe
from jetctl.run.ledger import ledger_from_files
from tests.client.client_fakes import TOKEN, FakeSwarm, start_fake_server

pytestmark = pytest.mark.integration

ROLES = {"seven": "big", "three": "small"}  # role -> model


def asked_digit(tokenizer: Any, prompt_ids: list[int]) -> str:
    found = re.findall(r"\d", tokenizer.decode(prompt_ids))
    return found[-1] if found else "?"


# the team task as `jetctl up` parses it from a recipe: its roles name the recipe's models
TEAM_RECIPE = """
run: {name: t}
models:
  big: {model: "builtin:tiny"}
  small: {model: "builtin:tiny"}
tasks:
  team:
    env: envs.digits.team:make_env
    agent: agents.digits:team_agent
    roles: {seven: big, three: small}
    env_args: {digits: {seven: 7, three: 3}, length: 4}
    group_size: 2
    concurrency: 2
"""
TEAM_TASK = parse_recipe(TEAM_RECIPE, file="team.yaml", env={}).tasks["team"]
assert TEAM_TASK.roles == ROLES


async def run_team_node(
    tmp_path: Path, fakes: list[FakeSwarm], max_groups: int, agent: str = "agents.digits:team_agent"
) -> ClientNode:
    servers = [(await start_fake_server(f, tmp_path))[0] for f in fakes]
    node = ClientNode(NodeConfig(
        name="team-0", task_name="team", task=TEAM_TASK, run_dir=tmp_path, token=TOKEN,
        agent=agent, max_groups=max_groups, install_signal_handlers=False, drain_grace_s=10,
    ))
    try:
        assert await node.run() == 0
    finally:
        for server in servers:
            await server.stop(None)
    return node


@pytest.mark.timeout(120)
async def test_each_role_reaches_its_model_and_trains_it_with_its_reward(
    tokenizer: Any, tokenizer_files: dict[str, bytes], tmp_path: Path
) -> None:
    # big answers every digit right (seven's reward 1.0); small gets half of three's (0.5)
    big = FakeSwarm(tokenizer, tokenizer_files, model="big",
                    reply_text=lambda p: asked_digit(tokenizer, p) * 4)
    small = FakeSwarm(tokenizer, tokenizer_files, model="small",
                      reply_text=lambda p: asked_digit(tokenizer, p) * 2 + "00")
    node = await run_team_node(tmp_path, [big, small], max_groups=3)

    assert [r.model for r in big.registers] == ["big"] and len(small.registers) == 1
    # each server generated only for its own role's prompts
    assert {asked_digit(tokenizer, list(g.prompt_ids)) for g in big.generate_calls} == {"7"}
    assert {asked_digit(tokenizer, list(g.prompt_ids)) for g in small.generate_calls} == {"3"}
    assert len(big.generate_calls) == len(small.generate_calls) == 6  # 3 groups x G=2
    for fake, role, reward in ((big, "seven", 1.0), (small, "three", 0.5)):
        assert len(fake.stored) == 3
        for group in fake.stored.values():
            assert group.model == fake.model and group.task == "team"
            for t in group.trajectories:
                assert t.role == role and t.reward == pytest.approx(reward)
                assert [c.model for c in t.calls] == [fake.model]
    # the two parts of a rollout have ids of their own and name the rollout they came from
    parts: dict[str, list[str]] = {}
    for fake in (big, small):
        for group in fake.stored.values():
            for t in group.trajectories:
                parts.setdefault(t.metadata["rollout_id"], []).append(t.id)
    assert len(parts) == 6 and all(len(ids) == 2 and len(set(ids)) == 2 for ids in parts.values())

    status = json.loads((tmp_path / "nodes" / "team-0.json").read_text())
    assert status["models"] == ["big", "small"] and status["roles"] == ROLES
    assert status["acks"] == {"accepted": 6} and status["spool_depth"] == 0
    generated = {
        fake.model: sum(
            min(len(fake.tokenizer.encode(fake.reply_text(list(g.prompt_ids)))) + 1, g.max_tokens)
            for g in fake.generate_calls
        )
        for fake in (big, small)
    }
    assert status["tokens_generated"] == generated
    books = ledger_from_files(tmp_path).summary()["by_model"]
    assert {m: (b["produced"], b["rejected"]) for m, b in books.items()} == {
        "big": (6, {}), "small": (6, {})}
    assert node.delivery.model == "big"


@pytest.mark.timeout(120)
async def test_one_models_refusal_is_that_models_alone(
    tokenizer: Any, tokenizer_files: dict[str, bytes], tmp_path: Path
) -> None:
    big = FakeSwarm(tokenizer, tokenizer_files, model="big")
    small = FakeSwarm(tokenizer, tokenizer_files, model="small",
                      ack_code=lambda g: pb.Ack.STALE)
    await run_team_node(tmp_path, [big, small], max_groups=2)
    assert len(big.stored) == 2 and not small.stored
    status = json.loads((tmp_path / "nodes" / "team-0.json").read_text())
    assert status["acks"] == {"accepted": 2, "stale": 2}
    books = ledger_from_files(tmp_path).summary()["by_model"]
    # the client's own records: big's parts wait in no server store here (a fake), so the
    # ledger sees its acks only; small's parts are rejected as stale, on small's books
    assert books["small"]["rejected"] == {"stale": 4} and books["small"]["produced"] == 4
    assert books["big"]["produced"] == 4


@pytest.mark.timeout(120)
async def test_a_role_the_agent_never_called_is_dropped_for_its_model_only(
    tokenizer: Any, tokenizer_files: dict[str, bytes], tmp_path: Path
) -> None:
    big = FakeSwarm(tokenizer, tokenizer_files, model="big")
    small = FakeSwarm(tokenizer, tokenizer_files, model="small")
    node = await run_team_node(
        tmp_path, [big, small], max_groups=2, agent="tests.client.client_fakes:first_role_agent"
    )
    assert len(big.stored) == 2 and not small.stored and not small.generate_calls
    spool = Spool(node.spool.path)
    dropped = {tid: (reason, error) for tid, reason, error in spool.dropped_rows()}
    assert len(dropped) == 4
    assert all(r == "failed" and "never called role 'three'" in e for r, e in dropped.values())
    books = ledger_from_files(tmp_path).summary()["by_model"]
    assert books["small"]["dropped"] == {"failed": 4}


class FakeControl(cpb_grpc.ControlServicer):
    """The controller's side of a node's link: every sync answers with the servers'
    endpoints (as the real hub does, jetctl.controller.hub) and keeps the node's status."""

    def __init__(self, servers: dict[str, str]) -> None:
        self.servers = servers
        self.statuses: list[dict[str, Any]] = []
        self.held = 0  # the node's ledger records taken so far

    async def Sync(
        self, request: cpb.SyncRequest, context: grpc.aio.ServicerContext
    ) -> cpb.SyncReply:
        self.statuses.append(json.loads(request.status_json))
        self.held = max([self.held, *(r.seq for r in request.records)])
        return cpb.SyncReply(servers=self.servers, journal_seq=self.held, known=True)


@pytest.mark.timeout(120)
async def test_a_team_node_finds_each_models_server_through_its_control_link(
    tokenizer: Any, tokenizer_files: dict[str, bytes], tmp_path: Path
) -> None:
    big = FakeSwarm(tokenizer, tokenizer_files, model="big")
    small = FakeSwarm(tokenizer, tokenizer_files, model="small")
    started = [await start_fake_server(f) for f in (big, small)]  # no servers/*.json anywhere
    control = FakeControl({"big": started[0][1], "small": started[1][1]})
    controller = grpc.aio.server()
    cpb_grpc.add_ControlServicer_to_server(control, controller)
    port = controller.add_insecure_port("127.0.0.1:0")
    await controller.start()
    node = ClientNode(NodeConfig(
        name="team-0", task_name="team", task=TEAM_TASK, run_dir=tmp_path / "node",
        token=TOKEN, max_groups=2, install_signal_handlers=False, drain_grace_s=10,
        link=ControlLink(f"127.0.0.1:{port}", TOKEN), status_interval_s=0.2,
    ))
    try:
        assert await node.run() == 0
    finally:
        for server, _ in started:
            await server.stop(None)
        await controller.stop(None)

    assert len(big.registers) == len(small.registers) == 1
    assert len(big.stored) == len(small.stored) == 2
    assert {g.model for g in big.stored.values()} == {"big"}
    assert {g.model for g in small.stored.values()} == {"small"}
    # what `jetctl status` shows of the node comes with its syncs: its models and roles
    last = control.statuses[-1]
    assert last["state"] == "exited" and last["models"] == ["big", "small"]
    assert last["roles"] == ROLES and last["acks"] == {"accepted": 4}
    assert not (tmp_path / "node" / "nodes").exists(), "a linked node writes no status file"
