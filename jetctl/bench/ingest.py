"""`jetctl bench ingest`: groups/s a real swarm server acks from K concurrent clients.

Starts a real `jetctl server --no-train` (builtin:tiny) on loopback, then P worker processes
that run K clients in all, each on its own gRPC channel, submitting ~4 KB groups (4
trajectories of one call) as fast as acks come back. Modes, side by side in one run: unary
Submit and the SubmitStream, with one or more groups per call (`unary` = 1, `unary x8` = 8
groups per call, as a node sends its spool's backlog). Every ack is a durable sqlite commit
(WAL, synchronous=FULL), batched across concurrent calls.

Reports per mode: groups/s, MB/s, p50/p99 ack latency, and where the CPU went: the server
process and the client processes, in cores used and CPU microseconds per group (the clients
share this machine's cores with the server). Afterwards it checks that the server's store
holds exactly the groups that were acked ACCEPTED.

The load generator is cheap on purpose: a group is serialized once and each send only writes
fresh ids into a copy of its bytes, so the clients' CPU goes to gRPC, not to building
messages. Left out: TLS, and the client node's spool (its own cost, on its own machine in a
real swarm).
"""

from __future__ import annotations

import asyncio
import multiprocessing
import sqlite3
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Self

from jetctl.bench.serve import BenchServer

SUBMIT = "/jetctl.swarm.v1.Swarm/Submit"
SUBMIT_STREAM = "/jetctl.swarm.v1.Swarm/SubmitStream"
MODES = ("unary", "stream")
RECIPE = """
run: {{name: bench-ingest}}
models:
  policy:
    model: builtin:tiny
    finetune: full
    train: {{max_staleness: 1000000}}
    limits: {{max_message_bytes: {limit}, max_buffer_groups: 100000000,
              max_buffer_bytes: 1099511627776}}
tasks:
  bench:
    env: envs.digits:make_env
    agent: agents.digits:agent
    model: policy
"""


@dataclass(frozen=True)
class Mode:
    kind: str  # unary | stream
    groups_per_call: int = 1

    @property
    def name(self) -> str:
        return self.kind if self.groups_per_call == 1 else f"{self.kind}:{self.groups_per_call}"


@dataclass
class IngestResult:
    mode: Mode
    server: str  # jetctl | floor (a gRPC server that parses and acks, nothing more)
    clients: int
    groups: int  # acked ACCEPTED
    calls: int
    seconds: float
    group_bytes: int
    p50_ms: float  # ack latency of one call
    p99_ms: float
    not_accepted: int
    server_cpu_s: float
    client_cpu_s: float

    @property
    def groups_per_s(self) -> float:
        return self.groups / self.seconds

    @property
    def mb_per_s(self) -> float:
        return self.groups * self.group_bytes / self.seconds / 1e6

    def cores(self, cpu_s: float) -> float:
        return cpu_s / self.seconds

    def us_per_group(self, cpu_s: float) -> float:
        return cpu_s / max(self.groups, 1) * 1e6


@dataclass(frozen=True)
class IngestRun:
    results: list[IngestResult]
    stored: int  # groups the server's store holds after the run
    acked: int  # groups acked ACCEPTED over every mode

    @property
    def nothing_lost(self) -> bool:
        return self.stored == self.acked


class GroupMaker:
    """A ~`group_bytes` TrajectoryGroup serialized once; each `request` writes fresh ids."""

    N_TRAJ = 4
    COMPLETION = 32

    def __init__(self, group_bytes: int) -> None:
        from jetctl.proto._gen import swarm_pb2 as pb

        per_traj = max(group_bytes // self.N_TRAJ, 200)
        # ids < 2048 take 2 bytes as varints, logprobs 4; ~120 bytes of ids and names
        prompt = max((per_traj - self.COMPLETION * 6 - 120) // 2, 8)
        self.group_marker = b"@" * 36  # a uuid7 has 36 characters
        self.traj_markers = [f"{'#' * 32}{i:04d}".encode() for i in range(self.N_TRAJ)]
        g = pb.TrajectoryGroup(id=self.group_marker.decode(), task="bench", task_id="t",
                               model="policy")
        for marker in self.traj_markers:
            t = g.trajectories.add(id=marker.decode(), group_id=g.id, task="bench",
                                   task_id="t", client_id="bench", client_revision="r0",
                                   status="ok", reward=0.5)
            t.calls.add(model="policy", prompt_ids=[200 + i % 500 for i in range(prompt)],
                        completion_ids=[600] * self.COMPLETION,
                        completion_logprobs=[-0.5] * self.COMPLETION, model_version=0,
                        finish_reason="stop")
        self.template = g.SerializeToString()

    @property
    def size(self) -> int:
        return len(self.template)

    def group(self) -> bytes:
        from jetctl.types import uuid7

        raw = self.template.replace(self.group_marker, uuid7().encode())
        for marker in self.traj_markers:
            raw = raw.replace(marker, uuid7().encode())
        return raw

    def request(self, n_groups: int) -> bytes:
        """A SubmitRequest's bytes: field 1 (groups), length-delimited, n times."""
        out = bytearray()
        for _ in range(n_groups):
            g = self.group()
            out += b"\x0a" + _varint(len(g)) + g
        return bytes(out)


def _varint(n: int) -> bytes:
    out = bytearray()
    while True:
        b = n & 0x7F
        n >>= 7
        if n:
            out.append(b | 0x80)
        else:
            out.append(b)
            return bytes(out)


@dataclass
class _Tally:
    latencies: list[float]
    accepted: int = 0
    other: int = 0
    calls: int = 0

    def count(self, reply: Any) -> None:
        from jetctl.proto._gen import swarm_pb2 as pb

        self.calls += 1
        for a in reply.acks:
            if a.code == pb.Ack.ACCEPTED:
                self.accepted += 1
            else:
                self.other += 1


async def _client(endpoint: str, token: str, mode: Mode, start_at: float, seconds: float,
                  maker: GroupMaker, tally: _Tally) -> None:
    import grpc

    from jetctl.auth import bearer
    from jetctl.proto._gen import swarm_pb2 as pb

    limit = [("grpc.max_send_message_length", 64 << 20)]
    async with grpc.aio.insecure_channel(endpoint, options=limit) as channel:
        await channel.channel_ready()
        await asyncio.sleep(max(0.0, start_at - time.time()))
        deadline = time.monotonic() + seconds
        metadata = bearer(token)
        if mode.kind == "unary":
            submit = channel.unary_unary(SUBMIT, request_serializer=None,
                                         response_deserializer=pb.SubmitReply.FromString)
            while time.monotonic() < deadline:
                request = maker.request(mode.groups_per_call)
                t0 = time.perf_counter()
                reply = await submit(request, metadata=metadata, timeout=60)
                tally.latencies.append(time.perf_counter() - t0)
                tally.count(reply)
            return
        stream = channel.stream_stream(SUBMIT_STREAM, request_serializer=None,
                                       response_deserializer=pb.SubmitReply.FromString)
        call = stream(metadata=metadata, timeout=seconds + 60)
        while time.monotonic() < deadline:
            request = maker.request(mode.groups_per_call)
            t0 = time.perf_counter()
            await call.write(request)
            reply = await call.read()
            tally.latencies.append(time.perf_counter() - t0)
            tally.count(reply)
        await call.done_writing()


def _worker(endpoint: str, token: str, mode: Mode, n_clients: int, seconds: float,
            group_bytes: int, start_at: float, conn: Any) -> None:
    maker = GroupMaker(group_bytes)
    tally = _Tally([])
    cpu: list[float] = []

    async def main() -> None:
        await asyncio.sleep(max(0.0, start_at - time.time()))
        cpu.append(time.process_time())
        await asyncio.gather(*[
            _client(endpoint, token, mode, start_at, seconds, maker, tally)
            for _ in range(n_clients)
        ])
        cpu.append(time.process_time())

    asyncio.run(main())
    conn.send((tally, time.time() - start_at, cpu[1] - cpu[0], maker.size))


def _measure(server: BenchServer | FloorServer, mode: Mode, clients: int, processes: int,
             seconds: float, group_bytes: int) -> IngestResult:
    ctx = multiprocessing.get_context("spawn")
    start_at = time.time() + 4.0  # every worker imports and connects first
    workers = []
    for i in range(processes):
        n = clients // processes + (1 if i < clients % processes else 0)
        parent, child = ctx.Pipe()
        p = ctx.Process(target=_worker, args=(server.endpoint, server.token, mode, n, seconds,
                                              group_bytes, start_at, child))
        p.start()
        workers.append((p, parent))
    time.sleep(max(0.0, start_at - time.time()))
    server_cpu0 = server.cpu_seconds()
    tallies: list[_Tally] = []
    wall = seconds
    client_cpu = 0.0
    size = 0
    for p, parent in workers:
        tally, took, cpu_s, size = parent.recv()
        tallies.append(tally)
        wall = max(wall, took)
        client_cpu += cpu_s
        p.join()
    server_cpu = server.cpu_seconds() - server_cpu0
    latencies = sorted(x for t in tallies for x in t.latencies)

    def q(f: float) -> float:
        return latencies[min(int(f * len(latencies)), len(latencies) - 1)] * 1000

    return IngestResult(
        mode=mode, server="floor" if isinstance(server, FloorServer) else "jetctl",
        clients=clients, groups=sum(t.accepted for t in tallies),
        calls=sum(t.calls for t in tallies), seconds=wall, group_bytes=size,
        p50_ms=q(0.5), p99_ms=q(0.99), not_accepted=sum(t.other for t in tallies),
        server_cpu_s=server_cpu, client_cpu_s=client_cpu,
    )


def stored_groups(store: Path) -> int:
    """Groups the server's store holds (read-only, beside the live writer)."""
    with sqlite3.connect(f"file:{store}?mode=ro", uri=True, timeout=10.0) as db:
        return int(db.execute("SELECT COUNT(*) FROM groups WHERE state='buffered'").fetchone()[0])


def run(clients: int = 50, seconds: float = 10.0, group_bytes: int = 4096, processes: int = 2,
        modes: tuple[Mode, ...] = (Mode("unary"), Mode("stream"), Mode("unary", 8)),
        floor: bool = False) -> IngestRun:
    """Start a server, measure each mode, check the store; stop the server. With `floor`,
    measure the same modes against a gRPC server that does no work, first."""
    results: list[IngestResult] = []
    if floor:
        with FloorServer() as noop:
            results += [_measure(noop, m, clients, processes, seconds, group_bytes)
                        for m in modes]
    with BenchServer(RECIPE.format(limit=16 << 20), train=False) as server:
        results += [_measure(server, m, clients, processes, seconds, group_bytes) for m in modes]
        stored = stored_groups(server.paths.store(server.model))
    return IngestRun(results, stored, sum(r.groups for r in results if r.server == "jetctl"))


class FloorServer:
    """A bare grpc.aio server in its own process, serving `methods(*args)` (a dict of
    Swarm method name -> grpc method handler; by default a Submit that parses the request
    and acks every group ACCEPTED without checking or storing it): what clients reach on
    gRPC alone."""

    token = "floor"

    def __init__(self, methods: Callable[..., dict[str, Any]] | None = None,
                 args: tuple[Any, ...] = ()) -> None:
        self._methods = methods or _submit_methods
        self._args = args

    def __enter__(self) -> Self:
        ctx = multiprocessing.get_context("spawn")
        ports: Any = ctx.Queue()
        self._proc = ctx.Process(target=_floor_main, args=(ports, self._methods, self._args),
                                 daemon=True)
        self._proc.start()
        self.endpoint = f"127.0.0.1:{ports.get(timeout=120)}"
        import psutil

        self._ps = psutil.Process(self._proc.pid)
        return self

    def __exit__(self, *exc: object) -> None:
        self._proc.terminate()
        self._proc.join(30)

    def cpu_seconds(self) -> float:
        t = self._ps.cpu_times()
        return float(t.user + t.system)


def _floor_main(ports: Any, methods: Callable[..., dict[str, Any]], args: tuple[Any, ...]) -> None:
    import grpc

    async def serve() -> None:
        handler = grpc.method_handlers_generic_handler("jetctl.swarm.v1.Swarm", methods(*args))
        server = grpc.aio.server(options=[("grpc.max_receive_message_length", 64 << 20),
                                          ("grpc.max_send_message_length", 64 << 20)])
        server.add_generic_rpc_handlers((handler,))
        port = server.add_insecure_port("127.0.0.1:0")
        await server.start()
        ports.put(port)
        await server.wait_for_termination()

    asyncio.run(serve())


def _submit_methods() -> dict[str, Any]:
    import grpc

    from jetctl.proto._gen import swarm_pb2 as pb

    def acks(raw: bytes) -> pb.SubmitReply:
        req = pb.SubmitRequest.FromString(raw)
        return pb.SubmitReply(acks=[pb.Ack(group_id=g.id, code=pb.Ack.ACCEPTED)
                                    for g in req.groups])

    async def submit(raw: bytes, _context: Any) -> pb.SubmitReply:
        return acks(raw)

    async def submit_stream(requests: Any, _context: Any) -> Any:
        async for raw in requests:
            yield acks(raw)

    ser = pb.SubmitReply.SerializeToString
    return {
        "Submit": grpc.unary_unary_rpc_method_handler(submit, None, ser),
        "SubmitStream": grpc.stream_stream_rpc_method_handler(submit_stream, None, ser),
    }


def parse_modes(text: str) -> tuple[Mode, ...]:
    """"unary,stream,unary:8" -> modes; ValueError naming what is wrong."""
    modes = []
    for part in (p.strip() for p in text.split(",")):
        if not part:
            continue
        kind, _, times = part.partition(":")
        if kind not in MODES:
            raise ValueError(f"{part!r}: a mode is unary or stream, optionally :N groups per call")
        try:
            n = int(times) if times else 1
        except ValueError:
            raise ValueError(f"{part!r}: N in {kind}:N must be a whole number") from None
        if not 1 <= n <= 256:
            raise ValueError(f"{part!r}: N in {kind}:N must be 1-256 (groups in one Submit)")
        modes.append(Mode(kind, n))
    if not modes:
        raise ValueError("give at least one mode")
    return tuple(modes)
