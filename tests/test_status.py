"""`jetctl status`: the JSON document, finding the run, and a dead controller's one-line error."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
from typer.testing import CliRunner

from jetctl.cli.main import build_app
from jetctl.proto._gen import control_pb2 as cpb
from jetctl.rundir import RunDirError, find_run_dir, update_latest_link, write_json_atomic
from jetctl.status import RunFinished, document, fetch_status, render_status

pytestmark = pytest.mark.unit

SERVER_FIGURES = {
    "model": "policy", "model_version": "7", "buffer_groups": "3", "accepted_groups": "5",
    "accepted_trajectories": "40", "rejected": {"stale": "2", "invalid": "1"},
    "trained_trajectories": "32", "trained_groups": "4", "reward_mean_recent": 0.25,
    "trajectories_per_second": 1.5, "received_by_task": {"arith": "48"},
    "reward_by_task": {"arith": 0.625},
}
CLIENT_FIGURES = {
    "name": "arith-0", "task": "arith", "state": "draining", "revision": "r0",
    "rollouts_done": 12, "rollouts_failed": 1, "rollouts_timeout": 0, "spool_depth": 2,
    "server_reachable": False,
}


def reply() -> cpb.RunStatusReply:
    return cpb.RunStatusReply(
        run="t", run_dir="/runs/t", uptime_s=12.5, state="running",
        nodes=[
            cpb.NodeStatus(name="server-policy", kind="server", model="policy", state="running",
                           pid=10, restarts=1, endpoint="127.0.0.1:5", json=json.dumps(SERVER_FIGURES)),
            cpb.NodeStatus(name="arith-0", kind="client", task="arith", model="policy",
                           state="running", pid=11, revision="r0", json=json.dumps(CLIENT_FIGURES)),
            cpb.NodeStatus(name="arith-1", kind="client", task="arith", model="policy",
                           state="restarting", restarts=2, revision="r0", json="{}"),
        ],
    )


def test_document_shape_and_types() -> None:
    doc = document(reply())
    assert set(doc) == {"run", "run_dir", "state", "uptime_s", "servers", "clients", "tasks"}
    assert doc["tasks"] == {"arith": {"revisions": ["r0"], "nodes": 2, "up": 1,
                                      "rollouts_done": 12, "spool_depth": 2, "received": 48,
                                      "reward": 0.625}}
    (s,) = doc["servers"]
    assert s["version"] == 7 and s["buffer_depth"] == 3 and s["accepted"] == 40
    assert s["rejected"] == {"stale": 2, "invalid": 1} and s["trained"] == 32
    assert s["restarts"] == 1 and s["reward_mean"] == 0.25
    c0, c1 = doc["clients"]
    assert c0["state"] == "draining" and c0["process_state"] == "running"  # the node's own word
    assert c0["rollouts_done"] == 12 and c0["spool_depth"] == 2 and c0["server_reachable"] is False
    assert c1["state"] == "restarting" and c1["rollouts_done"] is None and c1["restarts"] == 2
    json.dumps(doc)  # serialisable
    render_status(doc)
    from rich.console import Console

    console = Console(width=120, record=True)
    console.print(render_status(doc))
    assert "0.625" in console.export_text(), "the tasks table shows each task's reward"


def test_find_run_dir_prefers_latest_then_newest(tmp_path: Path) -> None:
    runs = tmp_path / "runs"
    with pytest.raises(RunDirError, match="jetctl up"):
        find_run_dir(None, runs)
    for name in ("a", "b"):
        write_json_atomic(runs / name / "run.json", {"run": name})
    os.utime(runs / "a" / "run.json", (1, 1))
    assert find_run_dir(None, runs) == (runs / "b").resolve()
    update_latest_link(runs / "latest", runs / "a")
    assert find_run_dir(None, runs) == (runs / "a").resolve()
    assert os.readlink(runs / "latest") == "a"


def test_dead_controller_is_one_line_not_a_traceback(tmp_path: Path) -> None:
    rd = tmp_path / "runs" / "t"
    info = {"run": "t", "recipe": "/r.yaml", "run_dir": str(rd), "state": "running",
            "controller": {"pid": 2**22 + 12345, "endpoint": "127.0.0.1:1"}}
    write_json_atomic(rd / "run.json", info)
    with pytest.raises(RunDirError, match="not running"):
        fetch_status(rd)
    res = CliRunner().invoke(build_app(), ["status", "--run-dir", str(rd), "--once", "--json"])
    assert res.exit_code == 1
    assert "not running" in res.output and "Traceback" not in res.output
    write_json_atomic(rd / "run.json", {**info, "state": "finished"})
    with pytest.raises(RunFinished):
        fetch_status(rd)
