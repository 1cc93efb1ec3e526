"""`jetctl bench pull`: PullWeights throughput on loopback, full weights and a LoRA adapter.

For each kind it starts a real `jetctl server --no-train` (the model's recipe with
`finetune: full` or `finetune: lora`) and pulls its weights with the client's own code
(`SwarmTransport.pull_weights`: chunks written into one buffer, size and sha256 checked),
first cold (the server hashes the version and cuts its frames: once per version), then
`repeats` times warm into a new payload buffer (the version's frames are cached; the
client's pages are faulted in as the chunks land) and `repeats` times warm as a node pulls
every version (into the previous pull's buffer, `PayloadBuffers`). Reports bytes, seconds,
MB/s and the CPU seconds of the server and of the pulling client, side by side.

With `floor`, each kind is first pulled from a bare `grpc.aio` server that streams the same
number of bytes in the same 4 MiB frames by a bare `grpc.aio` client that only counts them
(no auth, no checks, no hash, no copy): what gRPC in Python alone moves on this machine, the
ceiling for any PullWeights.

Left out: TLS, a pull across machines, and applying the weights to a local model (`jetctl
client`'s `LocalEngine.apply`, a cost of its own).
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from jetctl.bench.serve import BenchServer

FLOOR_FRAME_BYTES = 4 << 20  # the server's CHUNK_BYTES

KINDS = ("full", "lora")
RECIPE = """
run: {{name: bench-pull}}
models:
  policy:
    model: {model}
    finetune: {kind}
tasks:
  bench:
    env: envs.digits:make_env
    agent: agents.digits:agent
    model: policy
"""


@dataclass(frozen=True)
class PullResult:
    kind: str  # full | lora
    phase: str  # floor | cold | warm, new buffer | warm
    bytes: int
    seconds: float  # wall time of one pull, median over the phase's pulls
    server_cpu_s: float  # per pull
    client_cpu_s: float  # per pull
    pulls: int
    reused: int = 0  # pulls that wrote into the previous pull's buffer

    @property
    def mb_per_s(self) -> float:
        return self.bytes / self.seconds / 1e6


async def _pull_once(
    server: BenchServer, new_buffer: bool
) -> tuple[int, float, float, float, int]:
    """(bytes, wall s, server CPU s, client CPU s, buffer reused 0|1) of one verified
    PullWeights; into a new payload buffer with `new_buffer`, else as a node pulls."""
    from jetctl.client.transport import PAYLOAD_BUFFERS, SwarmTransport

    transport = SwarmTransport("policy", server.token, endpoint=server.endpoint,
                               call_timeout_s=600.0)
    try:
        await transport.register("bench-pull", "bench", "r0")
        if new_buffer:
            PAYLOAD_BUFFERS.clear()
        reused0 = PAYLOAD_BUFFERS.reused
        server_cpu0, client_cpu0 = server.cpu_seconds(), time.process_time()
        t0 = time.perf_counter()
        weights = await transport.pull_weights(have_version=-1)
        wall = time.perf_counter() - t0
        server_cpu, client_cpu = server.cpu_seconds(), time.process_time()
    finally:
        await transport.close()
    assert weights is not None, "a server at version 0 sends its weights to have_version -1"
    return (len(weights.data), wall, server_cpu - server_cpu0, client_cpu - client_cpu0,
            PAYLOAD_BUFFERS.reused - reused0)


def _median(xs: list[float]) -> float:
    s = sorted(xs)
    return s[len(s) // 2]


def measure(model: str, kind: str, repeats: int, floor: bool = False) -> list[PullResult]:
    with BenchServer(RECIPE.format(model=model, kind=kind), train=False) as server:
        cold = asyncio.run(_pull_once(server, new_buffer=True))
        phases = {
            "warm, new buffer": [asyncio.run(_pull_once(server, new_buffer=True))
                                 for _ in range(repeats)],
            "warm": [asyncio.run(_pull_once(server, new_buffer=False)) for _ in range(repeats)],
        }
    floor_rows = [_floor(kind, cold[0], max(repeats, 1))] if floor else []
    out = [PullResult(kind, "cold", cold[0], cold[1], cold[2], cold[3], 1, cold[4])]
    for phase, pulls in phases.items():
        if pulls:
            out.append(PullResult(
                kind, phase, pulls[0][0], _median([p[1] for p in pulls]),
                _median([p[2] for p in pulls]), _median([p[3] for p in pulls]), len(pulls),
                sum(p[4] for p in pulls),
            ))
    return floor_rows + out


def run(model: str = "builtin:smollm2-135m-instruct", kinds: tuple[str, ...] = KINDS,
        repeats: int = 3, on_kind: Callable[[str], None] | None = None,
        floor: bool = False) -> list[PullResult]:
    results: list[PullResult] = []
    for kind in kinds:
        if on_kind is not None:
            on_kind(kind)
        results += measure(model, kind, repeats, floor)
    return results


# --- the floor: gRPC alone -----------------------------------------------------------


def _floor(kind: str, total: int, pulls: int) -> PullResult:
    """`pulls` pulls of `total` bytes from a bare gRPC server (median)."""
    from jetctl.bench.ingest import FloorServer

    runs = []
    with FloorServer(_pull_methods, (total,)) as server:
        for _ in range(pulls + 1):  # the first warms the channel and the server's frames up
            s0, c0, t0 = server.cpu_seconds(), time.process_time(), time.perf_counter()
            got = asyncio.run(_floor_pull(server.endpoint))
            runs.append((time.perf_counter() - t0, server.cpu_seconds() - s0,
                         time.process_time() - c0))
            if got != total:
                raise RuntimeError(f"the floor server sent {got} of {total} bytes")
    runs = runs[1:]
    return PullResult(kind, "floor", total, _median([r[0] for r in runs]),
                      _median([r[1] for r in runs]), _median([r[2] for r in runs]), len(runs))


async def _floor_pull(endpoint: str) -> int:
    import grpc

    from jetctl.client.transport import PULL_WEIGHTS
    from jetctl.proto._gen import swarm_pb2 as pb

    async with grpc.aio.insecure_channel(
        endpoint, options=[("grpc.max_receive_message_length", 64 << 20)]
    ) as channel:
        pull = channel.unary_stream(PULL_WEIGHTS,
                                    request_serializer=pb.PullWeightsRequest.SerializeToString,
                                    response_deserializer=None)
        got = 0
        async for frame in pull(pb.PullWeightsRequest(have_version=-1)):
            got += len(frame)
        return got


def _pull_methods(total: int) -> dict[str, Any]:
    """A PullWeights that streams `total` bytes as 4 MiB frames, made once."""
    import grpc

    frames = [bytes(min(FLOOR_FRAME_BYTES, total - off))
              for off in range(0, total, FLOOR_FRAME_BYTES)]

    async def pull_weights(_raw: bytes, _context: Any) -> Any:
        for frame in frames:
            yield frame

    return {"PullWeights": grpc.unary_stream_rpc_method_handler(pull_weights, None, None)}
