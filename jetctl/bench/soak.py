"""`jetctl bench soak`: N groups through one real server (training on) from a node's real
spool and delivery, with the figures of each window of groups: is a long run as cheap at its
end as at its start?

    out = run(groups=1_000_000)      # SoakResult: one SoakWindow per `window` groups acked

A `jetctl server` (builtin:tiny, training on, `BenchServer`) and, in this process, what a node
runs to deliver: a `Spool` on disk, a `SwarmTransport` and a `Delivery` (batches of 8 groups,
BUSY and RESOURCE_EXHAUSTED honoured). The groups are scripted (`GroupMaker`, ~`group_bytes`
each, fresh ids, one trajectory rewarded 1.0 and the others 0.5, so each has a learning
signal and the server takes optimizer steps on it), not rolled out: the figures are of the server's and the spool's costs as
they age, not of an agent's. Per window: Submit p50/p99 (from the delivery's acks), the
latency of a Status call at the window's end (the median of `STATUS_CALLS`), the server's RSS,
the store's and the spool's bytes on disk (file + WAL). The first window ends at `EARLY`
groups (10k) when `window` is larger, so the end can be compared with a young run. At the
end: every group acked, and the store holds each once (nothing lost); `SoakResult.goals()`
checks the long-run goal (issue 25): Submit p99 and Status at the end within 1.5x of those
at 10k, the server's RSS at the end within +10% of that after the first 100k.

Left out: the controller (no `jetctl up`: one server, one in-process node), rollouts and
generation (the swarm's Generate path has `jetctl bench loop` and `bench ingest`).
"""

from __future__ import annotations

import asyncio
import sqlite3
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from jetctl.bench.ingest import GroupMaker
from jetctl.bench.serve import BenchServer

RECIPE = """
run: {name: bench-soak}
models:
  policy:
    model: builtin:tiny
    finetune: full
    train: {groups_per_step: 32, max_staleness: 1000000}
    limits: {max_buffer_groups: 4096}
tasks:
  bench:
    env: envs.digits:make_env
    agent: agents.digits:agent
    model: policy
"""
EARLY = 10_000  # the first window's edge when `window` is larger: "a young run"
STATUS_CALLS = 5  # Status calls per window's end; their median is the window's figure
GOAL_RATIO = 1.5  # Submit p99 and Status at the end vs at EARLY
GOAL_RSS = 1.10  # RSS at the end vs after RSS_FROM groups
RSS_FROM = 100_000
SPOOL_MAX_BYTES = 64 << 20  # the scripted node stops adding groups above this, as a node does
BATCH_GROUPS = 8  # a node's groups per Submit (DeliveryOptions' default)


@dataclass(frozen=True)
class SoakWindow:
    groups: int  # groups acked by the window's end
    submit_p50_ms: float
    submit_p99_ms: float
    status_ms: float
    server_rss_mib: float
    store_bytes: int
    spool_bytes: int
    trained_groups: int  # by the window's end, from the Status above (training is on)


@dataclass
class SoakResult:
    groups: int
    group_bytes: int
    seconds: float = 0.0
    stored: int = 0  # rows in the server's store at the end
    acked: int = 0  # groups the spool recorded an outcome for
    windows: list[SoakWindow] = field(default_factory=list)

    @property
    def nothing_lost(self) -> bool:
        return self.acked == self.groups and self.stored == self.groups

    def goals(self) -> list[tuple[str, float, float, bool]]:
        """(what, measured ratio, bound, met) for each long-run goal the windows can judge:
        the last window against the first (Submit p99, Status) and against the first window
        at or past RSS_FROM groups (RSS); none with fewer than two windows."""
        if len(self.windows) < 2:
            return []
        first, last = self.windows[0], self.windows[-1]
        out = []
        for what, a, b in (("submit p99", first.submit_p99_ms, last.submit_p99_ms),
                           ("status", first.status_ms, last.status_ms)):
            ratio = b / a if a > 0 else float("inf")
            out.append((f"{what} at {last.groups:,} / at {first.groups:,}", ratio, GOAL_RATIO,
                        ratio <= GOAL_RATIO))
        base = next((w for w in self.windows if w.groups >= RSS_FROM), None)
        if base is not None and base is not last:
            ratio = last.server_rss_mib / base.server_rss_mib
            out.append((f"server RSS at {last.groups:,} / at {base.groups:,}", ratio, GOAL_RSS,
                        ratio <= GOAL_RSS))
        return out

    def to_json(self) -> dict[str, Any]:
        out = asdict(self)
        out["nothing_lost"] = self.nothing_lost
        out["goals"] = [{"what": w, "ratio": r, "bound": b, "met": m}
                        for w, r, b, m in self.goals()]
        return out


def _disk_bytes(path: Path) -> int:
    """A sqlite file's bytes on disk with its WAL."""
    return sum(p.stat().st_size for p in (path, Path(f"{path}-wal")) if p.exists())


def _stored(store: Path) -> int:
    db = sqlite3.connect(f"file:{store}?mode=ro", uri=True)
    try:
        return int(db.execute("SELECT COUNT(*) FROM groups").fetchone()[0])
    finally:
        db.close()


async def _soak(server: BenchServer, groups: int, window: int, group_bytes: int) -> SoakResult:
    import grpc

    from jetctl.auth import bearer
    from jetctl.client.metrics import ClientMetrics, NodeStats
    from jetctl.client.spool import Spool
    from jetctl.client.transport import Delivery, DeliveryOptions, SwarmTransport
    from jetctl.proto._gen import swarm_pb2 as pb
    from jetctl.proto._gen import swarm_pb2_grpc as pb_grpc

    maker = GroupMaker(group_bytes)
    result = SoakResult(groups=groups, group_bytes=maker.size)
    spool_path = server.run_dir / "spool" / "soak-0.sqlite"
    spool = Spool(spool_path)
    store = server.paths.store(server.model)
    transport = SwarmTransport(server.model, server.token, run_dir=server.run_dir)
    await transport.register("soak-0", "bench", "r0")
    latencies: list[float] = []  # seconds per acked Submit, this window
    acked = 0

    def on_acked(seconds: float, n: int) -> None:
        nonlocal acked
        latencies.append(seconds)
        acked += n

    delivery = Delivery(spool, transport, NodeStats(), ClientMetrics(),
                        options=DeliveryOptions(batch_groups=BATCH_GROUPS), on_acked=on_acked)
    sender = asyncio.create_task(delivery.run())
    channel = grpc.aio.insecure_channel(server.endpoint)
    status = pb_grpc.SwarmStub(channel).Status
    t0 = time.monotonic()
    made, next_edge = 0, min(window, EARLY, groups)
    try:
        while acked < groups:
            while made < groups and spool.bytes() < SPOOL_MAX_BYTES and made - acked < 4096:
                g = pb.TrajectoryGroup.FromString(maker.group())
                g.trajectories[0].reward = 1.0  # rewards differ: a group with signal, trained
                raw = g.SerializeToString()
                spool.put(g.id, raw, len(g.trajectories),
                          trajectory_ids=[t.id for t in g.trajectories], model=server.model)
                made += 1
            delivery.wake()
            await asyncio.sleep(0.005)
            if acked >= next_edge:
                calls = []
                for _ in range(STATUS_CALLS):
                    ts = time.perf_counter()
                    reply = await status(pb.StatusRequest(), metadata=bearer(server.token),
                                         timeout=30)
                    calls.append((time.perf_counter() - ts) * 1000)
                status_ms = float(np.median(calls))
                ms = np.array(latencies or [0.0]) * 1000
                result.windows.append(SoakWindow(
                    groups=acked, submit_p50_ms=float(np.percentile(ms, 50)),
                    submit_p99_ms=float(np.percentile(ms, 99)), status_ms=status_ms,
                    server_rss_mib=server.rss_bytes() / (1 << 20),
                    store_bytes=_disk_bytes(store), spool_bytes=_disk_bytes(spool_path),
                    trained_groups=int(reply.trained_groups),
                ))
                latencies.clear()
                next_edge = min((next_edge // window + 1) * window, groups)
    finally:
        delivery.stop()
        await sender
        await transport.close()
        await channel.close()
    result.seconds = time.monotonic() - t0
    result.acked = sum(spool.counts().outcomes.values())
    spool.close()
    result.stored = _stored(store)
    return result


def run(groups: int = 1_000_000, window: int = 100_000, group_bytes: int = 1024) -> SoakResult:
    """Push `groups` groups through a fresh server; one `SoakWindow` per `window` acked."""
    if groups < 1 or window < 1:
        raise ValueError(f"groups ({groups}) and window ({window}) must be at least 1")
    with BenchServer(RECIPE, train=True) as server:
        return asyncio.run(_soak(server, groups, window, group_bytes))
