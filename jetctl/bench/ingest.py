"""`jetctl bench ingest`: groups/s a real swarm server acks from K concurrent clients.

Starts a real `jetctl server --no-train` (builtin:tiny) on loopback, then P worker
processes that run K clients in all, each on its own gRPC channel, submitting ~4 KB
groups as fast as acks come back, unary and streaming side by side. Every ack is a
durable sqlite commit (WAL, synchronous=FULL), batched across concurrent calls.
Reports groups/s, MB/s and p50/p99 ack latency per mode, and the ratio between modes.
"""

from __future__ import annotations

import asyncio
import json
import multiprocessing
import os
import socket
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

ROOT_RECIPE = """
run: {{name: bench}}
models:
  policy:
    model: builtin:tiny
    finetune: full
    train: {{max_staleness: 1000000}}
    limits: {{max_message_bytes: {limit}}}
tasks:
  bench:
    env: envs.digits:make_env
    agent: agents.digits:agent
    model: policy
"""


@dataclass
class IngestResult:
    mode: str
    clients: int
    groups: int
    seconds: float
    group_bytes: int
    p50_ms: float
    p99_ms: float
    non_accepted: int

    @property
    def groups_per_s(self) -> float:
        return self.groups / self.seconds

    @property
    def mb_per_s(self) -> float:
        return self.groups * self.group_bytes / self.seconds / 1e6


def _template(group_bytes: int) -> Any:
    from jetctl.proto._gen import swarm_pb2 as pb

    # 4 trajectories of one call; ids < 2048 take 2 bytes as varints, logprobs 4
    n_traj = 4
    per_traj = max(group_bytes // n_traj, 200)
    completion = 32
    prompt = max((per_traj - completion * 6 - 120) // 2, 8)
    g = pb.TrajectoryGroup(id="", task="bench", task_id="t", model="policy")
    for _ in range(n_traj):
        t = g.trajectories.add(task="bench", task_id="t", client_id="bench", client_revision="r0",
                               status="ok", reward=0.5)
        t.calls.add(model="policy", prompt_ids=[200 + i % 500 for i in range(prompt)],
                    completion_ids=[600] * completion, completion_logprobs=[-0.5] * completion,
                    model_version=0, finish_reason="stop")
    return g


def _fresh(template: Any) -> Any:
    from jetctl.proto._gen import swarm_pb2 as pb
    from jetctl.types import uuid7

    g = pb.TrajectoryGroup()
    g.CopyFrom(template)
    g.id = uuid7()
    for t in g.trajectories:
        t.id = uuid7()
        t.group_id = g.id
    return g


async def _client(endpoint: str, token: str, mode: str, deadline: float, template: Any,
                  latencies: list[float], bad: list[int]) -> None:
    import grpc

    from jetctl.auth import bearer
    from jetctl.proto._gen import swarm_pb2 as pb
    from jetctl.proto._gen import swarm_pb2_grpc

    async with grpc.aio.insecure_channel(endpoint) as channel:
        stub = swarm_pb2_grpc.SwarmStub(channel)
        if mode == "unary":
            while time.monotonic() < deadline:
                req = pb.SubmitRequest(groups=[_fresh(template)])
                t0 = time.perf_counter()
                reply = await stub.Submit(req, metadata=bearer(token), timeout=30)
                latencies.append(time.perf_counter() - t0)
                bad[0] += sum(a.code not in (pb.Ack.ACCEPTED, pb.Ack.DUPLICATE) for a in reply.acks)
            return
        call = stub.SubmitStream(metadata=bearer(token), timeout=600)
        while time.monotonic() < deadline:
            t0 = time.perf_counter()
            await call.write(pb.SubmitRequest(groups=[_fresh(template)]))
            reply = await call.read()
            latencies.append(time.perf_counter() - t0)
            bad[0] += sum(a.code not in (pb.Ack.ACCEPTED, pb.Ack.DUPLICATE) for a in reply.acks)
        await call.done_writing()


def _worker(endpoint: str, token: str, mode: str, n_clients: int, seconds: float,
            group_bytes: int, start_at: float, conn: Any) -> None:
    template = _template(group_bytes)
    latencies: list[float] = []
    bad = [0]

    async def main() -> None:
        await asyncio.sleep(max(0.0, start_at - time.time()))
        deadline = time.monotonic() + seconds
        await asyncio.gather(*[
            _client(endpoint, token, mode, deadline, template, latencies, bad)
            for _ in range(n_clients)
        ])

    asyncio.run(main())
    conn.send((latencies, bad[0], template.ByteSize()))


def _measure(endpoint: str, token: str, mode: str, clients: int, processes: int,
             seconds: float, group_bytes: int) -> IngestResult:
    ctx = multiprocessing.get_context("spawn")
    start_at = time.time() + 3.0  # let every worker import and connect first
    workers = []
    for i in range(processes):
        n = clients // processes + (1 if i < clients % processes else 0)
        parent, child = ctx.Pipe()
        p = ctx.Process(target=_worker, args=(endpoint, token, mode, n, seconds, group_bytes,
                                              start_at, child))
        p.start()
        workers.append((p, parent))
    latencies: list[float] = []
    bad = 0
    size = 0
    for p, parent in workers:
        lat, b, size = parent.recv()
        latencies += lat
        bad += b
        p.join()
    latencies.sort()
    q = lambda f: latencies[min(int(f * len(latencies)), len(latencies) - 1)] * 1000
    return IngestResult(mode, clients, len(latencies), seconds, size, q(0.5), q(0.99), bad)


def run(clients: int = 50, seconds: float = 10.0, group_bytes: int = 4096, processes: int = 2,
        modes: tuple[str, ...] = ("unary", "stream")) -> list[IngestResult]:
    """Start a server, measure each mode, stop the server; return the results."""
    from jetctl.auth import write_token

    with tempfile.TemporaryDirectory(prefix="jetctl-bench-") as d:
        run_dir = Path(d)
        token = "bench"
        write_token(run_dir / "token", token)
        recipe = run_dir / "recipe.yaml"
        recipe.write_text(ROOT_RECIPE.format(limit=16 << 20))
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        log = (run_dir / "server.log").open("w")
        server = subprocess.Popen(
            [sys.executable, "-m", "jetctl.cli.main", "server", "--recipe", str(recipe),
             "--model", "policy", "--run-dir", str(run_dir), "--port", str(port), "--no-train"],
            stdout=log, stderr=subprocess.STDOUT, env={**os.environ, "JETCTL_TOKEN": token},
        )
        try:
            ep_file = run_dir / "servers" / "policy.json"
            deadline = time.monotonic() + 180
            while not ep_file.exists():
                if server.poll() is not None or time.monotonic() > deadline:
                    raise RuntimeError("bench server failed:\n" + (run_dir / "server.log").read_text())
                time.sleep(0.2)
            endpoint = json.loads(ep_file.read_text())["endpoint"]
            return [_measure(endpoint, token, m, clients, processes, seconds, group_bytes)
                    for m in modes]
        finally:
            server.terminate()
            server.wait(60)
