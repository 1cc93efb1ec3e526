"""A fake `jetctl server` / `jetctl client` for controller tests: same argv, same protocol.

    python fake_node.py server --model M --run-dir D --port P
    python fake_node.py client --task T --index I --run-dir D --revision REV [--name N] [--agent A]

Both join the controller in `JETCTL_CONTROL` with `JETCTL_TOKEN` (`Control.Join`) and sync
like the real ones (`Control.Sync`, every 0.1 s), without a ledger journal. The server serves
gRPC health and a Swarm `Status` (token checked) whose model_version rises every FAKE_STEP_S
seconds, writes `metrics/<model>.steps.jsonl`, and echoes the revisions the controller tells
it to refuse. The client's status carries its agent (from its join, or --agent). Both append
"start"/"sigterm" lines to `<run_dir>/fake_events.log` and exit 0 on SIGTERM (or when a sync
says drain), unless their node name is in FAKE_IGNORE_TERM (comma-separated): then only
SIGKILL ends them.
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


class Control:
    """Join and Sync with the controller (blocking grpc)."""

    def __init__(self) -> None:
        import grpc

        from jetctl.proto._gen import control_pb2_grpc as cgrpc

        self.md = (("authorization", f"Bearer {os.environ['JETCTL_TOKEN']}"),)
        self.channel = grpc.insecure_channel(os.environ["JETCTL_CONTROL"], options=[
            ("grpc.initial_reconnect_backoff_ms", 200), ("grpc.max_reconnect_backoff_ms", 1000),
        ])
        self.stub = cgrpc.ControlStub(self.channel)

    def join(self, **fields: object):
        import grpc

        from jetctl.link import REFUSALS
        from jetctl.proto._gen import control_pb2 as cpb

        # like the real nodes (`jetctl.link.ControlLink.join`), wait for a controller that is
        # not (yet, again) listening: a controller killed mid-Join resets the connection
        # (UNAVAILABLE), and only a refusal ends the node
        while True:
            try:
                return self.stub.Join(cpb.JoinRequest(**fields), metadata=self.md, timeout=1,
                                      wait_for_ready=True)
            except grpc.RpcError as e:
                if e.code() in REFUSALS:
                    raise
                if STOP.is_set():  # SIGTERM before any controller answered: a clean exit
                    return None
                STOP.wait(0.1)

    def sync(self, status: dict, **fields: object):
        import grpc

        from jetctl.proto._gen import control_pb2 as cpb

        try:
            return self.stub.Sync(cpb.SyncRequest(status_json=json.dumps(status), **fields),
                                  metadata=self.md, timeout=5)
        except grpc.RpcError:
            return None


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
    control = Control()
    joined = control.join(kind="server", model=a.model)
    if joined is None:
        server.stop(0)
        return
    refused = list(joined.refused_revisions)
    steps = run_dir / "metrics" / f"{a.model}.steps.jsonl"
    steps.parent.mkdir(parents=True, exist_ok=True)
    written = 0
    while not STOP.wait(0.05):
        reply = control.sync(
            {"state": "running", "version": version(), "pid": os.getpid()},
            name=f"server-{a.model}", kind="server", model=a.model,
            endpoint=f"127.0.0.1:{a.port}", refused_revisions=refused,
        )
        if reply is not None:
            refused = list(reply.refused_revisions)
        while written < version():
            written += 1
            with open(steps, "a") as f:
                f.write(json.dumps({"step": written, "time": time.time(),
                                    "reward/mean": written / 10.0}) + "\n")
    server.stop(0)


def run_client(a: argparse.Namespace) -> None:
    control = Control()
    joined = control.join(kind="client", task=a.task, name=a.name or f"{a.task}-{a.index}",
                          revision=a.revision, index=a.index)
    if joined is None:
        return
    name, agent = joined.name, a.agent or joined.agent
    done = 0
    while not STOP.wait(0.1):
        done += 1
        reply = control.sync({
            "name": name, "task": a.task, "model": "", "state": "running",
            "revision": joined.revision, "rollouts_done": done, "rollouts_failed": 0,
            "rollouts_timeout": 0, "groups_spooled": done, "spool_depth": 1,
            "spool_bytes": 10, "server_reachable": True, "acks": {"ACCEPTED": done},
            "dropped": {}, "pid": os.getpid(), "updated_at": time.time(), "agent": agent,
        }, name=name, kind="client", task=a.task, revision=joined.revision)
        ignore = os.environ.get("FAKE_IGNORE_TERM", "").split(",")
        if reply is not None and reply.drain and name not in ignore:
            event(Path(a.run_dir), name, "drain-asked")
            break


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("kind", choices=["server", "client"])
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
