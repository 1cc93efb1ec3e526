"""The controller with fake nodes on loopback: start, status, restart, drain, stop, resume."""

from __future__ import annotations

import os
import signal
import stat
import subprocess
import sys
import time
from pathlib import Path

import grpc
import psutil
import pytest
from typer.testing import CliRunner

from jetctl.cli.main import build_app
from jetctl.controller.controller import Controller
from jetctl.link import call_control
from jetctl.proto._gen import control_pb2 as cpb
from jetctl.run.status import document
from jetctl.rundir import RunDirError
from tests.controller.controller_fakes import (
    FAKE_NODE,
    events,
    node_states,
    read_run_json,
    recipe_dict,
    wait_for,
    write_recipe,
)

pytestmark = [pytest.mark.integration, pytest.mark.timeout(90)]


def test_start_status_and_down_drains_clients_before_servers(make_controller, run_dir: Path) -> None:
    r = make_controller().start()
    ctl = r.ctl
    wait_for(r.all_running, what="server and 2 clients running")

    # run dir: token 0600, run.json per docs/CONTRACTS.md, runs/latest
    token_mode = stat.S_IMODE((run_dir / "token").stat().st_mode)
    assert token_mode == 0o600
    info = wait_for(lambda: read_run_json(run_dir)["clients"]["arith-1"]["pid"] and read_run_json(run_dir))
    assert info["run"] == "t" and info["run_dir"] == str(run_dir.resolve())
    assert info["controller"]["pid"] == os.getpid() and info["controller"]["endpoint"] == ctl.endpoint
    assert Path(info["recipe"]).is_absolute()
    assert set(info["servers"]) == {"policy"} and info["servers"]["policy"]["pid"] > 0
    assert info["clients"]["arith-0"]["task"] == "arith"
    assert info["clients"]["arith-0"]["revision"] == "r0"
    assert (run_dir.parent / "latest").resolve() == run_dir.resolve()

    # Control.Status with the token: node figures included (server Status, client node json)
    token = (run_dir / "token").read_text()
    wait_for(lambda: '"model_version"' in node_json(ctl.endpoint, token, "server-policy"),
             what="server figures")
    wait_for(lambda: '"rollouts_done"' in node_json(ctl.endpoint, token, "arith-0"),
             what="client figures")
    doc = document(call_control(ctl.endpoint, token, "Status", cpb.RunStatusRequest()))
    assert doc["state"] == "running" and doc["run"] == "t"
    (server,) = doc["servers"]
    assert server["model"] == "policy" and server["state"] == "running"
    assert server["version"] >= 0 and server["rejected"] == {"stale": 3}
    assert server["accepted"] == 40 and server["trained"] == 32 and server["buffer_depth"] == 2
    assert sorted(c["name"] for c in doc["clients"]) == ["arith-0", "arith-1"]
    client = doc["clients"][0]
    assert client["rollouts_done"] >= 1 and client["server_reachable"] is True
    assert client["revision"] == "r0" and client["restarts"] == 0

    # `jetctl status --once --json` prints the same document shape
    res = CliRunner().invoke(build_app(), ["status", "--run-dir", str(run_dir), "--once", "--json"])
    assert res.exit_code == 0, res.output
    assert '"servers"' in res.output and '"spool_depth"' in res.output

    # the token is required; a swap without a new image or agent is refused, saying so
    with pytest.raises(grpc.RpcError) as e:
        call_control(ctl.endpoint, "wrong", "Status", cpb.RunStatusRequest())
    assert e.value.code() == grpc.StatusCode.UNAUTHENTICATED
    with pytest.raises(grpc.RpcError) as e:
        call_control(ctl.endpoint, token, "SwapClients", cpb.SwapRequest(task="arith"))
    assert e.value.code() == grpc.StatusCode.FAILED_PRECONDITION
    assert "--agent" in (e.value.details() or "")

    reply = call_control(ctl.endpoint, token, "Down", cpb.DownRequest(grace_s=5))
    assert reply.ok
    r.thread.join(timeout=20)
    assert r.result == ["down"]

    ev = events(run_dir)
    sigterm = {name: t for t, name, what, _ in ev if what == "sigterm"}
    exited = {name for _, name, what, _ in ev if what == "exit"}
    assert set(sigterm) == {"server-policy", "arith-0", "arith-1"}
    assert exited == set(sigterm), "every node drained and exited by itself"
    assert sigterm["server-policy"] > max(sigterm["arith-0"], sigterm["arith-1"])
    assert read_run_json(run_dir)["state"] == "finished"
    assert not list((run_dir / "pids").glob("*.pid"))


def node_json(endpoint: str, token: str, name: str) -> str:
    reply = call_control(endpoint, token, "Status", cpb.RunStatusRequest())
    return next(n.json for n in reply.nodes if n.name == name)


def test_restart_after_kill_9_with_backoff_and_same_port(make_controller, run_dir: Path) -> None:
    r = make_controller().start()
    ctl = r.ctl
    wait_for(r.all_running, what="all running")

    def restarts(name: str) -> int:
        return next(n.restarts for n in ctl.status().nodes if n.name == name)

    def pid(name: str) -> int:
        return next(n.pid for n in ctl.status().nodes if n.name == name)

    # a client: first restart after restart_backoff_s (0.5), the next after twice that
    delays = []
    for expected in (1, 2):
        old = pid("arith-0")
        os.kill(old, signal.SIGKILL)
        t0 = time.monotonic()
        wait_for(lambda n=expected, o=old: restarts("arith-0") == n and pid("arith-0") != o,
                 what=f"restart {expected}")
        delays.append(time.monotonic() - t0)
        wait_for(lambda: node_states(ctl)["arith-0"] == "running", what="running again")
    # the backoff is 0.5 s, then doubled to 1.0 s; the tick (0.1 s) and a process start on a
    # busy 2-core box add up to ~2 s more, so only the upper bounds are loose
    assert 0.5 <= delays[0] < 0.5 + 2.5, delays
    assert 1.0 <= delays[1] < 1.0 + 2.5, delays
    assert restarts("arith-1") == 0

    # a server comes back on the port it had
    endpoint = read_run_json(run_dir)["servers"]["policy"]["endpoint"]
    os.kill(pid("server-policy"), signal.SIGKILL)
    wait_for(lambda: restarts("server-policy") == 1 and node_states(ctl)["server-policy"] == "running",
             what="server restarted and healthy")
    assert read_run_json(run_dir)["servers"]["policy"]["endpoint"] == endpoint
    assert r.stop() == "test"


def test_duration_stops_the_run_and_sigkills_a_node_that_ignores_sigterm(
    make_controller, run_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("FAKE_IGNORE_TERM", "arith-0")
    r = make_controller(recipe_dict(clients=1, duration_s=3.0))
    from dataclasses import replace

    r.ctl.opts = replace(r.ctl.opts, grace_s=1.0)
    t0 = time.monotonic()
    r.start()
    r.thread.join(timeout=30)
    assert r.result and r.result[0].startswith("duration_s")
    assert 3.0 <= time.monotonic() - t0 < 15.0
    ev = events(run_dir)
    assert any(n == "arith-0" and w == "sigterm" for _, n, w, _ in ev)
    assert not any(n == "arith-0" and w == "exit" for _, n, w, _ in ev), "it was SIGKILLed"
    assert any(n == "server-policy" and w == "exit" for _, n, w, _ in ev)
    assert not any(p.is_running() and p.status() != psutil.STATUS_ZOMBIE
                   for p in map(_proc, [pid for _, _, w, pid in ev if w == "start"]) if p)


def _proc(pid: int) -> psutil.Process | None:
    try:
        return psutil.Process(pid)
    except psutil.Error:
        return None


def test_max_steps_stops_the_run_and_writes_the_reward_curve(make_controller, run_dir: Path) -> None:
    data = recipe_dict(clients=1)
    data["models"]["policy"]["train"] = {"max_steps": 5}
    r = make_controller(data).start()
    r.thread.join(timeout=40)
    assert r.result == ["every model reached train.max_steps"]
    csv = (run_dir / "reward_curve.csv").read_text().splitlines()
    assert csv[0].startswith("model,batch,step,stepped,time,elapsed_s,reward_mean")
    assert len(csv) - 1 >= 5
    assert (run_dir / "reward_curve.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_a_model_done_at_max_steps_retires_its_task_while_another_model_trains(
    make_controller,
) -> None:
    """train.max_steps of one model of two: the task that trains it drains its client nodes,
    which stay down (their calls would go to a server that stopped); the other model's task
    keeps its node and the run goes on."""
    data = recipe_dict(clients=1)
    data["models"]["critic"] = {"model": "builtin:tiny"}
    data["models"]["policy"]["train"] = {"max_steps": 5}
    data["tasks"]["judge"] = {"env": "envs.fake:make_env", "agent": "agents.fake:agent",
                              "model": "critic", "clients": 1}
    r = make_controller(data).start()
    wait_for(lambda: node_states(r.ctl).get("judge-0") == "running", timeout_s=40,
             what="the critic's task running")
    wait_for(lambda: node_states(r.ctl).get("arith-0") == "exited", timeout_s=40,
             what="the policy's task drained at max_steps")
    time.sleep(1.0)  # many ticks later: not restarted, and nothing else stopped
    states = node_states(r.ctl)
    assert states["arith-0"] == "exited" and states["judge-0"] == "running"
    assert not r.result and r.thread.is_alive()
    r.ctl.request_stop("test over")
    r.thread.join(timeout=40)
    assert r.result == ["test over"]


RUN_CONTROLLER = """
import sys
sys.path.insert(0, {tests!r})
from pathlib import Path
from jetctl.controller.controller import Controller
from tests.controller.controller_fakes import FAST, fake_commands, write_recipe, recipe_dict
recipe, path = write_recipe(Path({tmp!r}), recipe_dict())
ctl = Controller(recipe, path, run_dir=Path({run_dir!r}), commands=fake_commands(path, Path({run_dir!r})), options=FAST)
ctl.setup()
ctl.install_signal_handlers()
ctl.serve_forever()
"""


def start_controller_process(tmp_path: Path, run_dir: Path) -> subprocess.Popen[bytes]:
    code = RUN_CONTROLLER.format(tests=str(FAKE_NODE.parent.parent.parent), tmp=str(tmp_path),
                                 run_dir=str(run_dir))
    with open(tmp_path / "controller.err", "wb") as err:
        proc = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.DEVNULL, stderr=err)
    wait_for(lambda: (run_dir / "run.json").exists()
             and all(c.get("pid") for c in read_run_json(run_dir)["clients"].values())
             and len([e for e in events(run_dir) if e[2] == "start"]) == 3,
             what="subprocess controller up")
    return proc


def test_resume_adopts_running_nodes_after_the_controller_is_killed(
    make_controller, tmp_path: Path, run_dir: Path
) -> None:
    proc = start_controller_process(tmp_path, run_dir)
    before = {name: pid for _, name, w, pid in events(run_dir) if w == "start"}
    proc.kill()
    proc.wait()
    time.sleep(0.5)
    assert all(psutil.pid_exists(p) for p in before.values()), "killing the controller kept the nodes"

    recipe, path = write_recipe(tmp_path, recipe_dict())
    with pytest.raises(RunDirError, match="--resume"):
        Controller(recipe, path, run_dir=run_dir).setup()

    r = make_controller(resume=True).start()
    wait_for(r.all_running, what="adopted nodes running")
    now = {n.name: n.pid for n in r.ctl.status().nodes}
    assert now == before
    assert all(n.restarts == 0 for n in r.ctl.status().nodes)
    assert r.stop() == "test"
    ev = events(run_dir)
    assert len([e for e in ev if e[2] == "start"]) == 3, "nothing was started twice"
    assert {n for _, n, w, _ in ev if w == "exit"} == set(before)


def test_down_without_a_controller_stops_the_nodes_from_pid_files(tmp_path: Path, run_dir: Path) -> None:
    proc = start_controller_process(tmp_path, run_dir)
    proc.kill()
    proc.wait()
    res = CliRunner().invoke(build_app(), ["status", "--run-dir", str(run_dir), "--once"])
    assert res.exit_code == 1 and "not running" in res.output and "Traceback" not in res.output
    res = CliRunner().invoke(build_app(), ["down", "--run-dir", str(run_dir), "--grace", "5"])
    assert res.exit_code == 0, res.output
    assert "stopped 3 node(s)" in res.output
    ev = events(run_dir)
    assert {n for _, n, w, _ in ev if w == "sigterm"} == {"server-policy", "arith-0", "arith-1"}
    assert read_run_json(run_dir)["state"] == "finished"
