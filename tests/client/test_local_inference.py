"""`inference: local`: a real node pulls the real server's weights and generates itself.

A real `jetctl server` (builtin:tiny, training on) and a real `jetctl client --max-groups`
on loopback. The node's calls must carry the version of the weights it pulled, and its
groups must be accepted and trained like any other.
"""

from __future__ import annotations

import json
import os
import re
import sqlite3
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import pytest

from jetctl.auth import write_token
from jetctl.proto._gen import swarm_pb2 as pb

pytestmark = [pytest.mark.integration, pytest.mark.timeout(300)]

ROOT = Path(__file__).resolve().parents[2]

RECIPE = """
run: {name: local}
models:
  policy:
    model: builtin:tiny
    finetune: full
    optimizer: {lr: 2.0e-3}
    train: {groups_per_step: 1, max_staleness: 4}
tasks:
  digits:
    env: envs.digits:make_env
    agent: agents.digits:agent
    model: policy
    group_size: 4
    concurrency: 4
    inference: local
    sampling: {max_tokens: 4}
"""


def test_local_inference_node_trains_the_server(tmp_path: Path) -> None:
    write_token(tmp_path / "token", "t")
    recipe = tmp_path / "r.yaml"
    recipe.write_text(RECIPE)
    env = {**os.environ, "JETCTL_TOKEN": "t"}
    cli = [sys.executable, "-m", "jetctl.cli.main"]
    server = subprocess.Popen(
        [*cli, "server", "--recipe", str(recipe), "--model", "policy", "--run-dir",
         str(tmp_path)], cwd=ROOT, env=env, stdout=(tmp_path / "server.log").open("w"),
        stderr=subprocess.STDOUT,
    )
    try:
        deadline = time.monotonic() + 120
        while not (tmp_path / "servers" / "policy.json").exists():
            assert server.poll() is None and time.monotonic() < deadline, (
                (tmp_path / "server.log").read_text())
            time.sleep(0.2)
        client = subprocess.run(
            [*cli, "client", "--recipe", str(recipe), "--task", "digits", "--index", "0",
             "--run-dir", str(tmp_path), "--max-groups", "6"],
            cwd=ROOT, env=env, capture_output=True, text=True, timeout=240, check=False,
        )
        assert client.returncode == 0, client.stdout[-3000:] + client.stderr[-3000:]
        node = json.loads((tmp_path / "nodes" / "digits-0.json").read_text())
        assert node["groups_spooled"] == 6 and node["spool_depth"] == 0
        assert sum(node["acks"].values()) == 6
        # read the store while the server runs: no checkpoint yet (every 10 steps), so
        # every group still has its payload
        db = sqlite3.connect(tmp_path / "server-policy" / "store.sqlite")
        rows = db.execute("SELECT state, payload FROM groups").fetchall()
        db.close()
        # inference: local: the node generated every token itself; the server, none
        info = json.loads((tmp_path / "servers" / "policy.json").read_text())
        with urllib.request.urlopen(f"http://{info['metrics']}/metrics", timeout=10) as r:
            exposed = r.read().decode()
        generated = re.search(r"^jetctl_server_tokens_generated_total (\S+)$", exposed,
                              re.MULTILINE)
        assert generated is not None and float(generated.group(1)) == 0.0
    finally:
        server.terminate()
        assert server.wait(60) == 0
    assert len(rows) == 6 and all(state in ("buffered", "trained") for state, _ in rows)
    # the versions in the node's calls are versions the server published (pulled weights)
    versions = set()
    for _, payload in rows:
        g = pb.TrajectoryGroup.FromString(payload)
        versions |= {c.model_version for t in g.trajectories for c in t.calls}
    # a row per optimizer step; none when every group so far had equal rewards (no signal)
    log = tmp_path / "metrics" / "policy.steps.jsonl"
    steps = [json.loads(x) for x in log.open()] if log.exists() else []
    published = {0} | {int(s["step"]) for s in steps}
    assert versions and versions <= published
