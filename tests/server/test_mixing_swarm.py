"""Mixing ratios on real processes: one real `jetctl server` (builtin:tiny, `train.mix`
{fast: 0.5, slow: 0.5}) and two real `jetctl client` nodes, one per task; the slow task's
rollouts each pause 1.5 s after their model call (its clients slowed to a third of the fast
task's speed or less, checked by what the server received). Over 20 batches each task's
share stays within 10% of its target, and Status shows the slow task starving."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import grpc
import pytest

from jetctl.auth import bearer, write_token
from jetctl.proto._gen import swarm_pb2 as pb
from jetctl.proto._gen import swarm_pb2_grpc

pytestmark = [pytest.mark.integration, pytest.mark.timeout(300)]

ROOT = Path(__file__).resolve().parents[2]
BATCHES = 20

RECIPE = """
run: {name: mix}
models:
  policy:
    model: builtin:tiny
    finetune: full
    optimizer: {lr: 1.0e-3}
    train: {groups_per_step: 2, max_staleness: 1000, mix: {fast: 0.5, slow: 0.5},
            mix_wait_s: 60}
    checkpoint: {every_steps: 1000}
tasks:
  fast:
    env: tests.server.mix_fakes:make_env
    agent: tests.server.mix_fakes:agent
    model: policy
    group_size: 4
    concurrency: 4
  slow:
    env: tests.server.mix_fakes:make_env
    env_args: {pause_s: 1.5}
    agent: tests.server.mix_fakes:agent
    model: policy
    group_size: 4
    concurrency: 4
"""


def status(endpoint: str) -> pb.StatusReply:
    with grpc.insecure_channel(endpoint) as channel:
        reply: pb.StatusReply = swarm_pb2_grpc.SwarmStub(channel).Status(
            pb.StatusRequest(), metadata=bearer("t"), timeout=10)
    return reply


def test_each_batch_holds_the_mix_while_one_tasks_clients_are_slowed(tmp_path: Path) -> None:
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
    clients: list[subprocess.Popen[bytes]] = []
    try:
        deadline = time.monotonic() + 120
        while not (tmp_path / "servers" / "policy.json").exists():
            assert server.poll() is None and time.monotonic() < deadline, (
                (tmp_path / "server.log").read_text())
            time.sleep(0.2)
        endpoint = json.loads((tmp_path / "servers" / "policy.json").read_text())["endpoint"]
        clients = [
            subprocess.Popen(
                [*cli, "client", "--recipe", str(recipe), "--task", task, "--index", "0",
                 "--run-dir", str(tmp_path)],
                cwd=ROOT, env=env, stdout=(tmp_path / f"{task}.log").open("w"),
                stderr=subprocess.STDOUT,
            )
            for task in ("fast", "slow")
        ]
        deadline = time.monotonic() + 200
        while (reply := status(endpoint)).model_version < BATCHES:
            assert all(c.poll() is None for c in clients) and time.monotonic() < deadline, (
                reply.model_version, (tmp_path / "slow.log").read_text()[-2000:])
            time.sleep(0.5)
        for c in clients:
            c.send_signal(signal.SIGTERM)
        for c in clients:
            assert c.wait(60) == 0
    finally:
        for c in clients:
            if c.poll() is None:
                c.kill()
        server.terminate()
        assert server.wait(60) == 0

    received = dict(reply.received_by_task)
    # the slow task's clients made at most a third of the fast task's groups
    assert received["fast"] >= 3 * received["slow"], received
    shares = dict(reply.batch_share_by_task)
    assert shares["fast"] == pytest.approx(0.5, abs=0.05), shares
    assert shares["slow"] == pytest.approx(0.5, abs=0.05), shares
    assert list(reply.starving_tasks) == ["slow"]
    assert dict(reply.backfilled_by_task) == {}, "the wait (60 s) was never used up"
    # staleness per task: versions behind at the step, within the recipe's bound
    staleness = dict(reply.staleness_by_task)
    assert set(staleness) == {"fast", "slow"} and all(0 <= v <= 1000 for v in staleness.values())
