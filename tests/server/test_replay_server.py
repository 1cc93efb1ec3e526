"""`jetctl replay` of steps a real `jetctl server` process trained (builtin:tiny, recipes/
tiny.yaml: full fine-tuning, the trainer in its own thread beside the engine): the
replayed loss and grad norm are bitwise the recorded ones."""

from __future__ import annotations

import json
import time
from pathlib import Path

import pytest

from jetctl import auth
from jetctl.auth import bearer
from jetctl.proto._gen import swarm_pb2 as pb
from jetctl.proto.convert import group_to_pb
from jetctl.recipe import load_recipe
from jetctl.run.replay import read_records, replay_run_step
from jetctl.rundir import RunPaths
from jetctl.server.checkpoint import CHECKPOINT_KEY, SignedDir
from tests.server.test_server_process import TOKEN, rollout_group, server, stub

__all__ = ["server"]  # the module's server fixture, used here
pytestmark = [pytest.mark.integration, pytest.mark.slow, pytest.mark.timeout(240)]  # ~70 s


def test_steps_of_a_real_server_replay_bitwise(server: tuple[str, Path]) -> None:
    endpoint, run_dir = server
    s = stub(endpoint)
    paths = RunPaths(run_dir)
    deadline = time.monotonic() + 90
    while len(read_records(paths.steps_log("policy"))) < 3:
        assert time.monotonic() < deadline, "the server did not train 3 steps"
        g = rollout_group(s, [0.0, 1.0, 0.5, 0.0])
        s.Submit(pb.SubmitRequest(groups=[group_to_pb(g)]), metadata=bearer(TOKEN), timeout=10)
        time.sleep(0.5)
    records = read_records(paths.steps_log("policy"))
    cfg = load_recipe(run_dir / "recipe.yaml").models["policy"]
    root = SignedDir(str(paths.checkpoints("policy")),
                     auth.read_private(paths.server_dir("policy") / CHECKPOINT_KEY))
    for n in sorted(records)[-3:]:
        c = replay_run_step(cfg, paths.store("policy"), paths.steps_log("policy"), root, n)
        assert c.identical, (n, c.differences, json.dumps(c.recorded.to_json()))
