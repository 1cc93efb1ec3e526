"""`jetctl bench pull`: PullWeights throughput on loopback, full weights and a LoRA adapter.

For each kind it starts a real `jetctl server --no-train` (the model's recipe with
`finetune: full` or `finetune: lora`) and pulls its weights with the client's own code
(`SwarmTransport.pull_weights`: chunks reassembled, size and sha256 checked), first cold
(the server serializes and hashes the version: once per version) and then `repeats` times
warm (the version's payload is cached). Reports bytes, seconds, MB/s and the CPU seconds of
the server and of the pulling client, side by side.

Left out: TLS, a pull across machines, and applying the weights to a local model (`jetctl
client`'s `LocalEngine.apply`, a cost of its own).
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable
from dataclasses import dataclass

from jetctl.bench.serve import BenchServer

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
    phase: str  # cold | warm
    bytes: int
    seconds: float  # wall time of one pull, median over the phase's pulls
    server_cpu_s: float  # per pull
    client_cpu_s: float  # per pull
    pulls: int

    @property
    def mb_per_s(self) -> float:
        return self.bytes / self.seconds / 1e6


async def _pull_once(server: BenchServer) -> tuple[int, float, float, float]:
    """(bytes, wall s, server CPU s, client CPU s) of one verified PullWeights."""
    from jetctl.client.transport import SwarmTransport

    transport = SwarmTransport("policy", server.token, endpoint=server.endpoint,
                               call_timeout_s=600.0)
    try:
        await transport.register("bench-pull", "bench", "r0")
        server_cpu0, client_cpu0 = server.cpu_seconds(), time.process_time()
        t0 = time.perf_counter()
        weights = await transport.pull_weights(have_version=-1)
        wall = time.perf_counter() - t0
        server_cpu, client_cpu = server.cpu_seconds(), time.process_time()
    finally:
        await transport.close()
    assert weights is not None, "a server at version 0 sends its weights to have_version -1"
    return len(weights.data), wall, server_cpu - server_cpu0, client_cpu - client_cpu0


def _median(xs: list[float]) -> float:
    s = sorted(xs)
    return s[len(s) // 2]


def measure(model: str, kind: str, repeats: int) -> list[PullResult]:
    with BenchServer(RECIPE.format(model=model, kind=kind), train=False) as server:
        cold = asyncio.run(_pull_once(server))
        warm = [asyncio.run(_pull_once(server)) for _ in range(repeats)]
    out = [PullResult(kind, "cold", cold[0], cold[1], cold[2], cold[3], 1)]
    if warm:
        out.append(PullResult(
            kind, "warm", warm[0][0], _median([w[1] for w in warm]),
            _median([w[2] for w in warm]), _median([w[3] for w in warm]), len(warm),
        ))
    return out


def run(model: str = "builtin:smollm2-135m-instruct", kinds: tuple[str, ...] = KINDS,
        repeats: int = 3, on_kind: Callable[[str], None] | None = None) -> list[PullResult]:
    results: list[PullResult] = []
    for kind in kinds:
        if on_kind is not None:
            on_kind(kind)
        results += measure(model, kind, repeats)
    return results
