"""Killing a node reaches its rollouts: each rollout is a process group of its own inside
the node's session, so a kill of the node's group alone would leave them (and what they
started) running. Real processes, no fakes."""

from __future__ import annotations

import subprocess
import sys
import time
from pathlib import Path

import pytest

from jetctl import proctree
from jetctl.client.rollout import reap_leftovers
from jetctl.controller.runtimes.base import NodeSpec
from jetctl.controller.runtimes.process import ProcessRuntime

pytestmark = pytest.mark.unit

# a "node" that starts a "rollout" in a process group of its own, which starts a helper
NODE = """
import os, subprocess, sys, time
pid = os.fork()
if pid == 0:
    os.setpgrp()
    helper = subprocess.Popen(["sleep", "3600"])
    open(sys.argv[1], "w").write(f"{os.getpid()} {helper.pid}")
    time.sleep(3600)
time.sleep(3600)
"""


def _wait_for(path: Path, timeout_s: float = 20.0) -> str:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if path.is_file() and path.read_text().strip():
            return path.read_text()
        time.sleep(0.05)
    raise AssertionError(f"{path} was not written")


def _gone(pids: list[int], timeout_s: float = 10.0) -> bool:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if not [p for p in pids if proctree._ids(p) is not None]:
            return True
        time.sleep(0.05)
    return False


def test_killing_a_node_kills_its_rollout_groups_and_their_helpers(tmp_path: Path) -> None:
    out = tmp_path / "pids.txt"
    runtime = ProcessRuntime(tmp_path)
    spec = NodeSpec(name="web-0", kind="client", argv=[sys.executable, "-c", NODE, str(out)],
                    log_path=tmp_path / "logs" / "web-0.log")
    handle = runtime.start(spec)
    rollout, helper = map(int, _wait_for(out).split())
    assert proctree._ids(rollout) == (rollout, handle.pid), "the rollout leads its own group"
    assert set(proctree.members(sid=handle.pid)) >= {handle.pid, rollout, helper}

    runtime.kill(handle)

    assert _gone([handle.pid, rollout, helper]), "the node's whole session was killed"
    assert not runtime.poll(handle).running


def test_a_restarted_node_reaps_the_groups_its_killed_predecessor_left(tmp_path: Path) -> None:
    registry = tmp_path / "rollouts"
    registry.mkdir()
    # a rollout leader that started a helper and then died: only its group remains
    leader = subprocess.Popen(["sh", "-c", "sleep 3600 & echo $! > helper; sleep 0.5"],
                              cwd=tmp_path, process_group=0)
    (registry / str(leader.pid)).write_text(proctree.start_time(leader.pid))
    helper = int(_wait_for(tmp_path / "helper"))
    leader.wait()
    assert proctree._ids(helper) == (leader.pid, proctree._ids(helper)[1])
    # a record whose pid now belongs to some other process is left alone
    bystander = subprocess.Popen(["sleep", "3600"], process_group=0)
    (registry / str(bystander.pid)).write_text("1")  # another start time
    (registry / "junk").write_text("x")

    try:
        assert reap_leftovers(registry) == 1
        assert _gone([helper])
        assert bystander.poll() is None, "a pid reused by another process is not killed"
        assert not list(registry.iterdir()), "the records are cleared"
    finally:
        bystander.kill()
        bystander.wait()
