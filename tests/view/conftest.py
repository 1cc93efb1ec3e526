"""A small run dir for the explorer's tests, written through the parts' own write APIs: the
server's `TrajectoryStore` (put, mark_trained, mark_rejected, forget_payloads), a client's
`Spool` (a failed trajectory dropped with its error), the step log's rows and a checkpoint's
folder as the server lays them out.

    trained   rewards (0, 1), two turns (versions 1, 2), trained at step 2
    flat      rewards (1, 1): consumed without signal at version 1
    stale     refused as stale at Submit
    buffered  waiting, its completion says "seven 7 and 3"
    forgotten trained at step 1, its payload dropped (as a checkpoint does)
    failed    one trajectory the node dropped as failed (never submitted)
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import pytest

from jetctl.client.spool import Spool
from jetctl.models import load_tokenizer
from jetctl.proto.convert import group_to_pb
from jetctl.rundir import RunPaths, write_json_atomic
from jetctl.server.store import GroupFacts, Put, TrajectoryStore
from jetctl.types import LLMCall, TrajectoryGroup, uuid7
from tests.factories import make_group

RECIPE = """
run: {name: view}
models:
  policy:
    model: builtin:tiny
    train: {groups_per_step: 1, max_staleness: 2}
tasks:
  digits:
    env: envs.digits:make_env
    agent: agents.digits:agent
    model: policy
    group_size: 2
"""
SEARCHED = "seven 7 and 3"


@dataclass(frozen=True)
class ViewRun:
    dir: Path
    trained: TrajectoryGroup
    flat: TrajectoryGroup
    stale: TrajectoryGroup
    buffered: TrajectoryGroup
    forgotten: TrajectoryGroup
    failed_id: str


def _two_turns(group: TrajectoryGroup) -> TrajectoryGroup:
    """The first member gets a second call (a tool result, then 3 more tokens at version 2)."""
    t = group.trajectories[0]
    first = t.calls[0]
    prompt = [*first.prompt_ids, *first.completion_ids, 9, 9]  # + the tool's result
    t.calls.append(LLMCall(model="policy", prompt_ids=prompt, completion_ids=[6, 7, 8],
                           completion_logprobs=[-0.1, -2.0, -5.0], model_version=2,
                           finish_reason="stop"))
    first.finish_reason = "tool_calls"
    return group


@pytest.fixture(scope="session")
def view_run(tmp_path_factory: pytest.TempPathFactory) -> ViewRun:
    rd = tmp_path_factory.mktemp("view") / "run"
    paths = RunPaths(rd)
    paths.make()
    (rd / "view.yaml").write_text(RECIPE)
    write_json_atomic(paths.run_json, {"run": "view", "recipe": str(rd / "view.yaml")})
    said = load_tokenizer("builtin:tiny", progress=False).encode(SEARCHED)
    trained = _two_turns(make_group(rewards=(0.0, 1.0), version=1))
    flat = make_group(rewards=(1.0, 1.0), version=1)
    stale = make_group(rewards=(0.0, 0.5), version=0)
    buffered = make_group(rewards=(0.0, 0.25), version=2, completion=tuple(said))
    forgotten = make_group(rewards=(0.5, 0.5), version=0)
    for g in (trained, flat, stale, buffered, forgotten):
        for t in g.trajectories:
            t.client_id = "digits-0"

    store = TrajectoryStore(paths.store("policy"))
    store.open(trained_through_step=0)
    puts = [Put(GroupFacts.of(g), group_to_pb(g).SerializeToString())
            for g in (forgotten, flat, trained, buffered)]
    puts.insert(2, Put(GroupFacts.of(stale), group_to_pb(stale).SerializeToString(),
                       outcome="stale", reason="stale: lag 3 > max_staleness 2"))
    store.put_many(puts).result(10)
    store.mark_trained([forgotten.id], 1)
    store.forget_payloads(through_step=1)  # as the checkpoint at step 1 would
    store.mark_trained([flat.id], 1)  # consumed without signal at version 1, payload kept
    store.mark_trained([trained.id], 2)
    store.close()

    spool = Spool(paths.spool("digits-0"))
    failed_id = uuid7()
    spool.drop(failed_id, "failed", "ValueError: the env crashed", model="policy")
    spool.close()

    with paths.steps_log("policy").open("w") as f:
        for step, groups in ((1, 1), (2, 1)):
            f.write(json.dumps({"step": float(step), "stepped": 1.0, "time": 1000.0 + step,
                                "reward/mean": 0.5, "groups": float(groups),
                                "groups/skipped": 1.0 if step == 1 else 0.0,
                                "trajectories": 2.0, "tokens_per_second": 50.0}) + "\n")
    ckpt = paths.checkpoints("policy") / "step-00000002"
    ckpt.mkdir(parents=True)
    (ckpt / "manifest.json").write_text("{}")
    return ViewRun(rd, trained, flat, stale, buffered, forgotten, failed_id)
