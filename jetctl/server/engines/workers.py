"""Several hf engines side by side, each on its own copy of the adapter (`generation.workers`).

On a CPU a decode step of a small model does not get much faster with a second torch thread:
its matrices are too small to split well (SmolLM2-135M at 10 rows, on the 2-core Xeon: 1.04
to 1.2x with two threads). Two batches decoded at the same time, each on one thread, do scale:
1.6 to 1.8x the tokens a second of one. So `generation.workers: N` runs N `HFEngine`s, each
with its own worker thread, its own `Replica` (the adapter copied; the frozen base shared, or
its own copy in `generation.dtype`) and its own gate, and `EngineWorkers` routes each request
to one of them.

Routing keeps what the hf engine shares within one worker:

* identical prompts (a GRPO group's G requests) go to the worker that took the first of them,
  so the prompt is prefilled once there;
* a conversation's next turn goes to the worker that served a prompt its own starts with (the
  earlier turns' KV is in that worker's cache);
* anything else, or a worker `IMBALANCE_ROWS` rows busier than the least busy one, goes to the
  least busy (rows generated plus requests queued; ties by turns).

Each worker takes every published version on its own (`publish` stages or copies it into each
replica), so two replies may name different versions for a moment; every reply still names
exactly the version that produced it, and the staleness gate bounds both.
"""

from __future__ import annotations

import asyncio
import itertools
import threading
from collections import OrderedDict

from jetctl.server.engines.base import EngineLoad, GenRequest, GenResult
from jetctl.server.engines.hf import HFEngine
from jetctl.server.engines.replica import Replica

RECENT_PROMPTS = 512  # prompts remembered for routing, least recently used out first
IMBALANCE_ROWS = 8  # a worker this many rows busier than the least busy loses the request


class EngineWorkers:
    """N `HFEngine`s behind the one engine contract; `publish` refreshes every replica."""

    def __init__(self, engines: list[HFEngine], replicas: list[Replica]) -> None:
        if not engines or len(engines) != len(replicas):
            raise ValueError("one replica per engine, at least one")
        self.engines = engines
        self.replicas = replicas
        self._lock = threading.Lock()
        self._recent: OrderedDict[tuple[int, ...], int] = OrderedDict()  # prompt -> worker
        self._turn = itertools.count()
        self.routed = [0] * len(engines)  # requests sent to each worker (figures)
        self.followed = 0  # of them, sent after a prompt they repeat or extend

    @property
    def busy_since(self) -> float | None:
        starts = [e.busy_since for e in self.engines if e.busy_since is not None]
        return min(starts) if starts else None

    def start(self) -> None:
        for i, engine in enumerate(self.engines):
            engine.start(name=f"engine-{i}")

    async def stop(self) -> None:
        await asyncio.gather(*(e.stop() for e in self.engines))

    def load(self) -> EngineLoad:
        loads = [e.load() for e in self.engines]
        return EngineLoad(
            sum(x.rows for x in loads), sum(x.max_rows for x in loads),
            sum(x.queued for x in loads),
        )

    async def generate(self, req: GenRequest) -> GenResult:
        return await self.engines[self.route(req.prompt_ids)].generate(req)

    def route(self, prompt_ids: list[int]) -> int:
        """The worker for a prompt (see the module); remembers the choice."""
        prompt = tuple(prompt_ids)
        busy = [x.rows + x.queued for x in (e.load() for e in self.engines)]
        least = min(busy)
        with self._lock:
            owner = self._owner(prompt)
            if owner is None or busy[owner] - least >= IMBALANCE_ROWS:
                idle = [i for i, b in enumerate(busy) if b == least]
                pick = idle[next(self._turn) % len(idle)]
            else:
                pick = owner
                self.followed += 1
            self._recent[prompt] = pick
            self._recent.move_to_end(prompt)
            while len(self._recent) > RECENT_PROMPTS:
                self._recent.popitem(last=False)
            self.routed[pick] += 1
        return pick

    def _owner(self, prompt: tuple[int, ...]) -> int | None:
        """The worker of this prompt, else of the longest remembered prompt it starts with."""
        if prompt in self._recent:
            return self._recent[prompt]
        best, owner = 0, None
        for seen, worker in self._recent.items():
            n = len(seen)
            if best < n < len(prompt) and prompt[:n] == seen:
                best, owner = n, worker
        return owner

    def publish(self, version: int) -> float:
        """Stage or copy `version` into every worker's replica; returns the seconds."""
        return sum(r.publish(version) for r in self.replicas)

    def take_figures(self) -> dict[str, float]:
        """The workers' generation figures, summed (the batch size: the mean over all their
        decode steps), with `generate/workers` and each worker's share of the requests."""
        parts = [e.take_figures() for e in self.engines]
        out = {k: sum(p[k] for p in parts) for k in parts[0]}
        steps = sum(p["generate/decode_steps"] for p in parts)
        rows = sum(p["generate/batch_size_mean"] * p["generate/decode_steps"] for p in parts)
        out["generate/batch_size_mean"] = rows / steps if steps else 0.0
        out["generate/workers"] = float(len(self.engines))
        with self._lock:
            total = sum(self.routed) or 1
            out["generate/routed_max_share"] = max(self.routed) / total
            out["generate/routed_followed"] = float(self.followed)
            self.routed = [0] * len(self.engines)
            self.followed = 0
        return out

