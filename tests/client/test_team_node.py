"""A team task's node against two fake swarm servers, one per model: each role's calls reach
its own model's server, each role's part of a group goes to that server with the role's
reward, and one server's refusal stays that server's."""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

import pytest

from jetctl.client.node import ClientNode, NodeConfig
from jetctl.client.spool import Spool
from jetctl.ledger import build_ledger
from jetctl.proto._gen import swarm_pb2 as pb
from jetctl.recipe import TaskConfig
from tests.client.client_fakes import TOKEN, FakeSwarm, start_fake_server

pytestmark = pytest.mark.integration

ROLES = {"seven": "big", "three": "small"}  # role -> model


def asked_digit(tokenizer: Any, prompt_ids: list[int]) -> str:
    found = re.findall(r"\d", tokenizer.decode(prompt_ids))
    return found[-1] if found else "?"


async def run_team_node(
    tmp_path: Path, fakes: list[FakeSwarm], max_groups: int, agent: str = "agents.digits:team_agent"
) -> ClientNode:
    servers = [(await start_fake_server(f, tmp_path))[0] for f in fakes]
    task = TaskConfig(
        env="envs.digits.team:make_env", agent=agent, roles=ROLES,
        env_args={"digits": {"seven": 7, "three": 3}, "length": 4}, group_size=2, concurrency=2,
    )
    node = ClientNode(NodeConfig(
        name="team-0", task_name="team", task=task, run_dir=tmp_path, token=TOKEN,
        max_groups=max_groups, install_signal_handlers=False, drain_grace_s=10,
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
    books = build_ledger(tmp_path).summary()["by_model"]
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
    books = build_ledger(tmp_path).summary()["by_model"]
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
    books = build_ledger(tmp_path).summary()["by_model"]
    assert books["small"]["dropped"] == {"failed": 4}
