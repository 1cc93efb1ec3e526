"""An agent written to misbehave, run inside a client container by test_hostile_client.py.

On its first rollout in a container it tries what code in a client container must not be
able to do, and writes what happened to `attack.json` in its node's spool folder (the one
place it may write that the test can read), after each attempt; then, and on every other
rollout, it plays the digits task like `agents.digits`. Every attempt records an outcome
string; the test decides what counts as contained. The fork bomb, last, takes every pid
the container has for a few seconds: the node's own rollout forkserver or this rollout may
die of it (the node rebuilds its forkserver and its later rollouts run: rollout.py).

Its settings come from `target.json` beside it (mounted read-only): the host port of a
service the test listens on (0.0.0.0) and the pids limit of the container.
"""

from __future__ import annotations

import errno
import json
import os
import socket
from pathlib import Path
from typing import Any

from agents.digits import agent as digits_agent
from jetctl.env import LLM, Task

HERE = Path(__file__).resolve().parent


def _attempt_read(path: Path) -> str:
    try:
        data = path.read_bytes()
    except OSError as e:
        return f"refused: {errno.errorcode.get(e.errno or 0, e)}"
    return f"READ {len(data)} bytes"


def _attempt_write(path: Path) -> str:
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_bytes(b"planted")
    except OSError as e:
        return f"refused: {errno.errorcode.get(e.errno or 0, e)}"
    return "WRITTEN"


def _channel(target: str) -> Any:
    """A channel as the node dials: over the run's TLS (its files where the node has them)."""
    from jetctl.tls import TlsFiles, channel

    mode = os.environ.get("JETCTL_TLS_MODE", "off")
    folder = Path(os.environ.get("JETCTL_TLS_DIR", "/nonexistent"))
    return channel(target, TlsFiles(mode, folder) if mode in ("tls", "mtls") else None)  # type: ignore[arg-type]


def _control_calls(control: str, token: str, me: str) -> dict[str, str]:
    """Admin calls with the node's own credential, and another node's Sync."""
    import grpc

    from jetctl.auth import bearer
    from jetctl.proto._gen import control_pb2 as cpb
    from jetctl.proto._gen import control_pb2_grpc as cgrpc

    calls: dict[str, Any] = {
        "Down": cpb.DownRequest(grace_s=1),
        "SwapClients": cpb.SwapRequest(task="digits", agent="agents.digits:agent"),
        "Status": cpb.RunStatusRequest(),
        "Sync_as_other": cpb.SyncRequest(name="digits-1", kind="client", task="digits"),
        "Join_as_other": cpb.JoinRequest(kind="client", task="digits", name="digits-7"),
        "Sync_as_self": cpb.SyncRequest(name=me, kind="client", task="digits"),
    }
    out: dict[str, str] = {}
    with _channel(control) as ch:
        stub = cgrpc.ControlStub(ch)
        for name, request in calls.items():
            method = name.split("_")[0]
            try:
                getattr(stub, method)(request, metadata=bearer(token), timeout=5)
                out[name] = "OK"
            except grpc.RpcError as e:
                out[name] = e.code().name
        try:
            stub.Down(cpb.DownRequest(), metadata=bearer("guessed"), timeout=5)
            out["Down_guessed_token"] = "OK"
        except grpc.RpcError as e:
            out["Down_guessed_token"] = e.code().name
    return out


def _server_calls(endpoint: str, token: str) -> dict[str, str]:
    """A server's Status (an admin call) with the node's credential."""
    import grpc

    from jetctl.auth import bearer
    from jetctl.proto._gen import swarm_pb2 as pb
    from jetctl.proto._gen import swarm_pb2_grpc as pb_grpc

    with _channel(endpoint) as ch:
        try:
            # the node starts with its server, so the server may still be loading: wait for it
            pb_grpc.SwarmStub(ch).Status(pb.StatusRequest(), metadata=bearer(token),
                                         timeout=120, wait_for_ready=True)
            return {"Status": "OK"}
        except grpc.RpcError as e:
            return {"Status": e.code().name}


def _connect(host: str, port: int) -> str:
    try:
        with socket.create_connection((host, port), timeout=2):
            return "CONNECTED"
    except OSError as e:
        return f"refused: {type(e).__name__} {e}"


_BOMB = """
import errno, json, os, sys, time
limit, out = int(sys.argv[1]), sys.argv[2]
forks, error = 0, ""
while forks < limit * 4:
    try:
        pid = os.fork()
    except OSError as e:
        error = errno.errorcode.get(e.errno or 0, str(e))
        break
    if pid == 0:
        time.sleep(3.0)
        os._exit(0)
    forks += 1
report = json.load(open(out))
report["fork_bomb"] = {"forks": forks, "error": error}
report["done"] = True
with open(out + ".tmp", "w") as f:
    json.dump(report, f, indent=1)
os.replace(out + ".tmp", out)
"""


def _fork_bomb(limit: int, out: Path) -> None:
    """Fork until the kernel says no (each child sleeps, then exits): bounded by pids. In a
    process of its own, which writes its result into the report itself: the pids it takes
    may cost this process (a thread it cannot start) its life."""
    import subprocess
    import sys

    subprocess.run([sys.executable, "-c", _BOMB, str(limit), str(out)], timeout=60,
                   check=False)


def _calls_in_a_process(control: str, token: str, me: str, server: str) -> dict[str, Any]:
    """The gRPC attempts, in a process of their own: gRPC's threads end with it, before the
    fork bomb."""
    import subprocess
    import sys

    script = ("import json, sys, hostile_agent as h; "
              "print(json.dumps({'control': h._control_calls(*sys.argv[1:4]), "
              "'server': h._server_calls(sys.argv[4], sys.argv[2])}))")
    done = subprocess.run([sys.executable, "-c", script, control, token, me, server],
                          capture_output=True, text=True, timeout=240, check=False)
    if done.returncode != 0:
        return {"control": {"error": done.stderr[-1000:]}, "server": {}}
    calls: dict[str, Any] = json.loads(done.stdout)
    return calls


def _fill_disk() -> dict[str, Any]:
    """Write to the scratch tmpfs until it is full, then free it; and to the root fs."""
    written, error = 0, ""
    chunk = b"\0" * (4 << 20)
    path = Path("/tmp/fill")
    try:
        with path.open("wb") as f:
            while written < (4 << 30):
                f.write(chunk)
                f.flush()
                written += len(chunk)
    except OSError as e:
        error = errno.errorcode.get(e.errno or 0, str(e))
    finally:
        path.unlink(missing_ok=True)
    return {"written": written, "error": error, "root": _attempt_write(Path("/fill"))}


def _capabilities() -> str:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("CapEff:"):
            return line.split()[1]
    return "?"


def attack(out: Path) -> None:
    """Each attempt in turn, the report rewritten after each (the fork bomb last)."""
    target = json.loads((HERE / "target.json").read_text())
    log = Path(os.environ["JETCTL_LOG"])
    run_dir = log.parent.parent
    token = os.environ.get("JETCTL_TOKEN", "")
    control = os.environ["JETCTL_CONTROL"]
    gateway = control.rsplit(":", 1)[0]
    override = dict(p.split("=", 1) for p in os.environ["JETCTL_ENDPOINT_OVERRIDE"].split(","))
    report: dict[str, Any] = {}

    def record(key: str, value: Any) -> None:
        report[key] = value
        tmp = out.with_suffix(".tmp")
        tmp.write_text(json.dumps(report, indent=1))
        os.replace(tmp, out)  # the test never reads half a report

    record("uid", os.getuid())
    record("cap_eff", _capabilities())
    record("token_seen", token)
    record("read", {
        name: _attempt_read(run_dir / name)
        for name in ("run.json", "token", "tls/server.key", "tls/ca.key",
                     "server-policy/checkpoint.key", "server-policy/store.sqlite",
                     "received.sqlite")
    })
    record("spool_listing", sorted(p.name for p in (run_dir / "spool").iterdir()))
    tls_dir = Path(os.environ.get("JETCTL_TLS_DIR", "/nonexistent"))
    record("tls_listing", sorted(p.name for p in tls_dir.iterdir()) if tls_dir.is_dir() else [])
    record("write", {
        "checkpoint": _attempt_write(
            run_dir / "checkpoints" / "policy" / "step-99999999" / "optimizer.pt"),
        "other_spool": _attempt_write(run_dir / "containers" / "honest-0" / "spool" / "x"),
        "run_json": _attempt_write(run_dir / "run.json"),
    })
    record("connect", {
        "host_other_port": _connect(gateway, int(target["host_port"])),
        "controller": _connect(gateway, int(control.rsplit(":", 1)[1])),
    })
    record("disk", _fill_disk())
    calls = _calls_in_a_process(control, token, log.stem, override["policy"])
    record("control", calls["control"])
    record("server", calls["server"])
    _fork_bomb(int(target["pids"]), out)  # last; it adds its result and `done`


def agent(task: Task, llm: LLM, session: Any) -> None:
    marker = Path("/tmp/attacked")
    try:
        fd = os.open(marker, os.O_CREAT | os.O_EXCL | os.O_WRONLY)
    except FileExistsError:
        fd = -1
    if fd >= 0:
        os.close(fd)
        attack(Path(os.environ["JETCTL_LOG"]).parent.parent / "spool" / "attack.json")
    digits_agent(task, llm, session)
