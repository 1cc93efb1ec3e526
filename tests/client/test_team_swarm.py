"""A two-model team on real servers: each server trains only on its own role's calls.

Two real `jetctl server` processes (builtin:tiny each, training on) and one real `jetctl
client` on loopback, on the team digits task: role `seven` (model `big`) is asked for 7s,
role `three` (model `small`) for 3s, in the same rollouts, each scored on its own reply. The
node runs until both servers stepped a few times (groups without signal take no step:
dynamic sampling), then drains (SIGTERM). We check what a user would: both versions rose;
each server generated exactly the tokens the node's calls to it asked for (its /metrics
against the node's own count per model); each server holds only its role's trajectories,
each with its role's reward (recomputed from the reply); and each model's books balance on
their own in the ledger.
"""

from __future__ import annotations

import json
import os
import re
import signal
import sqlite3
import subprocess
import sys
import time
import urllib.request
from pathlib import Path
from typing import Any

import pytest

from envs.digits.env import score
from jetctl.auth import write_token
from jetctl.proto._gen import swarm_pb2 as pb
from jetctl.run.ledger import ledger_from_files

pytestmark = [pytest.mark.integration, pytest.mark.timeout(300)]

ROOT = Path(__file__).resolve().parents[2]
G = 4
VERSIONS = 2  # each server must reach this version (optimizer steps) before the node drains
LENGTH = 8  # tokens per reply (the agent's max_tokens): the untrained model writes the asked
# digit rarely, and a group with no reply holding it has no signal and takes no step

RECIPE = f"""
run: {{name: team}}
models:
  big:
    model: builtin:tiny
    finetune: full
    optimizer: {{lr: 2.0e-3}}
    train: {{groups_per_step: 1, max_staleness: 8}}
    checkpoint: {{every_steps: 100}}   # no checkpoint: stored groups keep their payload
  small:
    model: builtin:tiny
    finetune: full
    optimizer: {{lr: 2.0e-3}}
    train: {{groups_per_step: 1, max_staleness: 8}}
    checkpoint: {{every_steps: 100}}
    seed: 1
tasks:
  team:
    env: envs.digits.team:make_env
    env_args: {{digits: {{seven: 7, three: 3}}, length: {LENGTH}}}
    agent: agents.digits:team_agent
    roles: {{seven: big, three: small}}
    group_size: {G}
    concurrency: {G}
    sampling: {{max_tokens: {LENGTH}}}
"""
ROLES = {"big": ("seven", "7"), "small": ("three", "3")}  # model -> (role, its digit)


def scrape(metrics: str, name: str) -> float:
    text = urllib.request.urlopen(f"http://{metrics}/metrics", timeout=10).read().decode()
    found = re.search(rf"^{name} ([0-9.e+]+)$", text, re.MULTILINE)
    assert found, f"{name} not in /metrics"
    return float(found.group(1))


def steps(run_dir: Path, model: str) -> list[dict[str, Any]]:
    """The server's step log: one row per optimizer step."""
    log = run_dir / "metrics" / f"{model}.steps.jsonl"
    return [json.loads(x) for x in log.open()] if log.exists() else []


def test_each_server_trains_only_its_roles_calls(tmp_path: Path, tokenizer: Any) -> None:
    write_token(tmp_path / "token", "t")
    recipe = tmp_path / "r.yaml"
    recipe.write_text(RECIPE)
    env = {**os.environ, "JETCTL_TOKEN": "t"}
    cli = [sys.executable, "-m", "jetctl.cli.main"]
    servers = {
        m: subprocess.Popen(
            [*cli, "server", "--recipe", str(recipe), "--model", m, "--run-dir", str(tmp_path)],
            cwd=ROOT, env=env, stdout=(tmp_path / f"{m}.log").open("w"), stderr=subprocess.STDOUT,
        )
        for m in ROLES
    }
    client: subprocess.Popen[bytes] | None = None
    try:
        deadline = time.monotonic() + 120
        for m, proc in servers.items():
            while not (tmp_path / "servers" / f"{m}.json").exists():
                assert proc.poll() is None and time.monotonic() < deadline, (
                    (tmp_path / f"{m}.log").read_text())
                time.sleep(0.2)
        client = subprocess.Popen(
            [*cli, "client", "--recipe", str(recipe), "--task", "team", "--index", "0",
             "--run-dir", str(tmp_path)],
            cwd=ROOT, env=env, stdout=(tmp_path / "client.log").open("w"),
            stderr=subprocess.STDOUT,
        )
        deadline = time.monotonic() + 150
        while min(len(steps(tmp_path, m)) for m in ROLES) < VERSIONS:
            assert client.poll() is None and time.monotonic() < deadline, (
                {m: len(steps(tmp_path, m)) for m in ROLES},
                (tmp_path / "client.log").read_text()[-3000:])
            time.sleep(0.5)
        client.send_signal(signal.SIGTERM)  # drain: finish the rollouts, flush the spool
        assert client.wait(60) == 0, (tmp_path / "client.log").read_text()[-3000:]
        node = json.loads((tmp_path / "nodes" / "team-0.json").read_text())
        generated = {
            m: scrape(json.loads((tmp_path / "servers" / f"{m}.json").read_text())["metrics"],
                      "jetctl_server_tokens_generated_total")
            for m in ROLES
        }
        time.sleep(3)  # let each trainer take the last group it holds
        stored = {}
        for m in ROLES:
            db = sqlite3.connect(tmp_path / f"server-{m}" / "store.sqlite")
            stored[m] = db.execute("SELECT state, payload FROM groups").fetchall()
            db.close()
        ledger = ledger_from_files(tmp_path)
    finally:
        if client is not None and client.poll() is None:
            client.kill()
        for proc in servers.values():
            proc.terminate()
        for proc in servers.values():
            assert proc.wait(60) == 0

    assert node["models"] == ["big", "small"] and node["roles"] == {"seven": "big",
                                                                     "three": "small"}
    groups = len(stored["big"])
    assert groups == len(stored["small"]) and groups == node["groups_spooled"] // 2
    assert node["acks"] == {"accepted": 2 * groups} and node["spool_depth"] == 0
    # each server generated exactly the tokens of the calls the node sent it (and > 0)
    assert {m: int(n) for m, n in generated.items()} == node["tokens_generated"]
    assert all(n > 0 for n in generated.values())

    for m, (role, digit) in ROLES.items():
        completion_tokens = 0
        for _state, payload in stored[m]:
            group = pb.TrajectoryGroup.FromString(payload)
            assert group.model == m and len(group.trajectories) == G
            for t in group.trajectories:
                assert t.role == role and [c.model for c in t.calls] == [m]
                reply = tokenizer.decode(list(t.calls[0].completion_ids), skip_special_tokens=True)
                # the role's own reward: its reply scored against its own digit
                assert t.reward == pytest.approx(score(reply, digit, LENGTH)), (role, reply)
                completion_tokens += len(t.calls[0].completion_ids)
        # every generated token is in a stored trajectory of this server: nothing else's
        assert completion_tokens == node["tokens_generated"][m]

        rows = steps(tmp_path, m)
        versions = [int(s["step"]) for s in rows if s["stepped"]]
        assert versions == sorted(versions) and versions[-1] >= VERSIONS, (m, rows)
        # what it trained on and what it consumed without signal: its own groups only
        assert sum(int(s["trajectories"]) + int(s["trajectories/skipped"]) for s in rows) <= (
            groups * G)

    books = ledger.summary()["by_model"]
    for m in ROLES:
        assert books[m]["produced"] == groups * G and books[m]["balanced"], books[m]
        assert books[m]["rejected"] == {} and books[m]["dropped"] == {}
    assert ledger.balanced
