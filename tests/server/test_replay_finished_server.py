"""`jetctl replay` after a real `jetctl server` process ended (builtin:tiny, recipes/tiny.yaml
with `train.max_steps: 6` and `checkpoint.keep_trained_groups: all`: full fine-tuning, the
trainer in its own thread beside the engine, then SIGTERM: the last checkpoint, the store
closed): three steps chosen at random replay bitwise, from the seeded start where `keep`
pruned the checkpoint before them."""

from __future__ import annotations

import json
import random
import subprocess
import sys
import time
from pathlib import Path

import pytest

from jetctl import auth
from jetctl.auth import bearer, write_token
from jetctl.proto._gen import swarm_pb2 as pb
from jetctl.proto.convert import group_to_pb
from jetctl.recipe import load_recipe
from jetctl.run.replay import read_records, replay_run_step
from jetctl.rundir import RunPaths
from jetctl.server.checkpoint import CHECKPOINT_KEY, SignedDir
from tests.server.test_server_process import ROOT, TOKEN, free_port, rollout_group, stub

pytestmark = [pytest.mark.integration, pytest.mark.timeout(480)]  # ~15 s on an idle host


def test_steps_of_a_finished_server_run_chosen_at_random_replay_bitwise(tmp_path: Path) -> None:
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    write_token(run_dir / "token", TOKEN)
    recipe = run_dir / "recipe.yaml"
    recipe.write_text((ROOT / "recipes" / "tiny.yaml").read_text()
                      .replace("max_staleness: 2", "max_staleness: 2\n      max_steps: 6")
                      .replace("every_steps: 20", "every_steps: 2\n      keep: 2\n"
                               "      keep_trained_groups: all"))
    log = (run_dir / "server.log").open("w")
    proc = subprocess.Popen(
        [sys.executable, "-m", "jetctl.cli.main", "server", "--recipe", str(recipe),
         "--model", "policy", "--run-dir", str(run_dir), "--port", str(free_port())],
        stdout=log, stderr=subprocess.STDOUT, cwd=ROOT,
    )
    try:
        paths = RunPaths(run_dir)
        deadline = time.monotonic() + 150
        while not paths.server_file("policy").exists():
            assert proc.poll() is None, (run_dir / "server.log").read_text()[-3000:]
            assert time.monotonic() < deadline, "the server did not come up"
            time.sleep(0.2)
        s = stub(json.loads(paths.server_file("policy").read_text())["endpoint"])
        deadline = time.monotonic() + 180
        while len(read_records(paths.steps_log("policy"))) < 6:
            assert time.monotonic() < deadline, "the server did not train 6 steps"
            g = rollout_group(s, [0.0, 1.0, 0.5, 0.0])
            s.Submit(pb.SubmitRequest(groups=[group_to_pb(g)]), metadata=bearer(TOKEN),
                     timeout=10)
    finally:
        proc.terminate()
        code = proc.wait(60)
    assert code == 0, (run_dir / "server.log").read_text()[-3000:]

    records = read_records(paths.steps_log("policy"))
    assert sorted(records) == list(range(1, 7))
    cfg = load_recipe(recipe).models["policy"]
    root = SignedDir(str(paths.checkpoints("policy")),
                     auth.read_private(paths.server_dir("policy") / CHECKPOINT_KEY))
    seed = random.randrange(2**32)
    for n in sorted(random.Random(seed).sample(sorted(records), 3)):
        c = replay_run_step(cfg, paths.store("policy"), paths.steps_log("policy"), root, n)
        assert c.identical, (seed, n, c.differences, json.dumps(c.recorded.to_json()))
