"""A fake `jetctl server` / `jetctl client` for controller tests: same argv, same run-dir files.

    python fake_node.py server --recipe R --model M --run-dir D --port P
    python fake_node.py client --recipe R --task T --index I --run-dir D --revision REV
        [--name N] [--agent A]

The server serves gRPC health and a Swarm `Status` (token checked) whose model_version rises
every FAKE_STEP_S seconds, writes `servers/<model>.json` and `metrics/<model>.steps.jsonl`.
The client writes `nodes/<name>.json` (default name `<task>-<index>`) every 0.2 s, with
its agent; the server echoes `refused/<model>.json` in its servers file, as the real one. Both append "start"/"sigterm"
lines to `<run_dir>/fake_events.log` and exit 0 on SIGTERM, unless their node name is in
FAKE_IGNORE_TERM (comma-separated): then only SIGKILL ends them.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import sys
import threading
import time
from pathlib import Path

STOP = threading.Event()


def event(run_dir: Path, name: str, what: str) -> None:
    with open(run_dir / "fake_events.log", "a") as f:
        f.write(f"{time.time():.3f} {name} {what} {os.getpid()}\n")


def write_json(path: Path, data: dict) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    # per-process tmp name: two fakes writing one file (a swap's new node under the old
    # node's name) must not rename each other's tmp away
    tmp = path.with_name(f".{path.name}.tmp{os.getpid()}")
    tmp.write_text(json.dumps(data))
    os.replace(tmp, path)


def on_term(run_dir: Path, name: str) -> None:
    ignore = os.environ.get("FAKE_IGNORE_TERM", "").split(",")

    def handler(signum: int, frame: object) -> None:
        event(run_dir, name, "sigterm")
        if name not in ignore:
            STOP.set()

    signal.signal(signal.SIGTERM, handler)


def run_server(a: argparse.Namespace) -> None:
    from concurrent import futures

    import grpc
    from grpc_health.v1 import health, health_pb2, health_pb2_grpc

    from jetctl.proto._gen import swarm_pb2 as spb
    from jetctl.proto._gen import swarm_pb2_grpc as sgrpc

    run_dir = Path(a.run_dir)
    step_s = float(os.environ.get("FAKE_STEP_S", "0.2"))
    token = os.environ["JETCTL_TOKEN"]
    t0 = time.time()

    def version() -> int:
        return int((time.time() - t0) / step_s)

    class Swarm(sgrpc.SwarmServicer):
        def Status(self, request, context):
            md = dict(context.invocation_metadata())
            if md.get("authorization") != f"Bearer {token}":
                context.abort(grpc.StatusCode.UNAUTHENTICATED, "bad token")
            return spb.StatusReply(
                model=a.model, model_version=version(), buffer_groups=2, accepted_groups=5,
                accepted_trajectories=40, rejected={"stale": 3}, trained_trajectories=32,
                reward_mean_recent=0.5, trajectories_per_second=4.0, pid=os.getpid(),
            )

    server = grpc.server(futures.ThreadPoolExecutor(max_workers=2))
    sgrpc.add_SwarmServicer_to_server(Swarm(), server)
    hs = health.HealthServicer()
    hs.set("", health_pb2.HealthCheckResponse.SERVING)
    health_pb2_grpc.add_HealthServicer_to_server(hs, server)
    server.add_insecure_port(f"127.0.0.1:{a.port}")
    server.start()
    write_json(run_dir / "servers" / f"{a.model}.json", {
        "model": a.model, "endpoint": f"127.0.0.1:{a.port}", "metrics": "", "pid": os.getpid(),
        "version": 0,
    })
    steps = run_dir / "metrics" / f"{a.model}.steps.jsonl"
    steps.parent.mkdir(parents=True, exist_ok=True)
    written = 0
    refused_file = run_dir / "refused" / f"{a.model}.json"
    while not STOP.wait(0.05):
        if refused_file.is_file():
            refused = json.loads(refused_file.read_text())["revisions"]
            info = json.loads((run_dir / "servers" / f"{a.model}.json").read_text())
            if info.get("refused_revisions") != refused:
                write_json(run_dir / "servers" / f"{a.model}.json",
                           {**info, "refused_revisions": refused})
        while written < version():
            written += 1
            with open(steps, "a") as f:
                f.write(json.dumps({"step": written, "time": time.time(),
                                    "reward/mean": written / 10.0}) + "\n")
    server.stop(0)


def run_client(a: argparse.Namespace) -> None:
    run_dir, name = Path(a.run_dir), a.name or f"{a.task}-{a.index}"
    done = 0
    while not STOP.wait(0.2):
        done += 1
        write_json(run_dir / "nodes" / f"{name}.json", {
            "name": name, "task": a.task, "model": "", "state": "running",
            "revision": a.revision, "rollouts_done": done, "rollouts_failed": 0,
            "rollouts_timeout": 0, "groups_spooled": done, "spool_depth": 1,
            "spool_bytes": 10, "server_reachable": True, "acks": {"ACCEPTED": done},
            "dropped": {}, "pid": os.getpid(), "updated_at": time.time(), "agent": a.agent,
        })


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("kind", choices=["server", "client"])
    p.add_argument("--recipe", required=True)
    p.add_argument("--run-dir", required=True)
    p.add_argument("--model")
    p.add_argument("--port", type=int)
    p.add_argument("--metrics-port", type=int)
    p.add_argument("--task")
    p.add_argument("--index", type=int)
    p.add_argument("--revision", default="r0")
    p.add_argument("--name")
    p.add_argument("--agent")
    a = p.parse_args()
    name = f"server-{a.model}" if a.kind == "server" else a.name or f"{a.task}-{a.index}"
    run_dir = Path(a.run_dir)
    on_term(run_dir, name)
    event(run_dir, name, "start")
    run_server(a) if a.kind == "server" else run_client(a)
    event(run_dir, name, "exit")
    sys.exit(0)


if __name__ == "__main__":
    main()
