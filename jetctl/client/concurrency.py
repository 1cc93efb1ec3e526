"""`concurrency: auto`: how many rollouts a node keeps running, sized by what its server says.

    slots = Slots(governor.limit)            # the producer's rollouts take a slot each
    governor.observe(reply.load)             # every Generate reply carries the server's Load
    decision = governor.decide(slots.peak()) # every interval_s: a new limit, with its reason

A node whose env answers slowly spends most of a rollout waiting on the world; the server's
engine then sees few requests and the trainer waits for groups. A fixed `concurrency` has
to be tuned by hand for each env's latency (the quickstart with 2 s env answers needed 16
per node, where 8 is right without latency). Instead, every `interval_s` the node reads the
Load of the replies it got since the last look and moves its limit by one group (G):

- **down** when the engine queued requests (it is full: more rollouts only wait for a row
  and come back staler), or when the trainer had a backlog of `FED_STEPS` steps' groups the
  whole time (generation is ahead of training; what is made now waits and grows stale);
- **up** when the trainer was short of a step's groups and every slot of the node was in use
  (the env's waits leave the engine room: more rollouts in flight fill it);
- otherwise it holds.

The limit stays within [G, MAX_GROUPS x G]: at least one group, since a group's G rollouts
are batched together. Nodes of one model decide alone from the same server figures, so they
move together; the server never waits on them. A number in the recipe is a fixed limit and
no governor runs. Left out: sizing by the node's own CPU or memory (the recipe's
`resources` bound a container), and engines that do not report rows (vLLM, continuous:
their queue is their own, so only the trainer's backlog steers).
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

START = 8  # rollouts at first (at least one group): what a fixed default used to be
FED_STEPS = 4  # a trainer backlog of this many steps' groups: generation is ahead
MAX_GROUPS = 8  # the limit's ceiling, in groups of G rollouts
INTERVAL_S = 3.0  # about one one-turn rollout: the effect of the last move shows by then


@dataclass(frozen=True)
class Decision:
    limit: int
    why: str  # shown in `jetctl status`


class Slots:
    """A semaphore whose limit can change while rollouts hold it; remembers the most slots
    in use since the last `peak()`."""

    def __init__(self, limit: int) -> None:
        self.limit = limit
        self.used = 0
        self._peak = 0
        self._cond = asyncio.Condition()

    async def __aenter__(self) -> None:
        async with self._cond:
            await self._cond.wait_for(lambda: self.used < self.limit)
            self.used += 1
            self._peak = max(self._peak, self.used)

    async def __aexit__(self, *exc: object) -> None:
        async with self._cond:
            self.used -= 1
            self._cond.notify_all()

    async def resize(self, limit: int) -> None:
        async with self._cond:
            self.limit = limit
            self._cond.notify_all()

    def peak(self) -> int:
        """The most slots in use since the last call (at least those in use now)."""
        peak, self._peak = self._peak, self.used
        return peak


@dataclass
class _Window:
    replies: int = 0
    queued_sum: float = 0.0
    buffer_min: int | None = None
    buffer_sum: float = 0.0
    groups_per_step: int = 1
    max_rows: int = 0


class Governor:
    """Decides a node's rollout limit from the server Loads it observed (see the module)."""

    def __init__(
        self, group_size: int, start: int, *, interval_s: float = INTERVAL_S,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.group_size = group_size
        self.floor = group_size
        self.ceiling = MAX_GROUPS * group_size
        self.limit = min(max(start, self.floor), self.ceiling)
        self.why = "start"
        self.interval_s = interval_s
        self._clock = clock
        self._last = clock()
        self._window = _Window()

    def observe(self, load: Any) -> None:
        """A Generate reply's `Load` (jetctl.proto swarm.Load)."""
        w = self._window
        w.replies += 1
        w.queued_sum += load.engine_queued
        buffer = int(load.buffer_groups)
        w.buffer_min = buffer if w.buffer_min is None else min(w.buffer_min, buffer)
        w.buffer_sum += buffer
        w.groups_per_step = max(1, int(load.groups_per_step))
        w.max_rows = int(load.engine_max_rows)

    def decide(self, peak_used: int) -> Decision | None:
        """A new limit once `interval_s` has passed since the last look (None before then,
        or when no reply came in the window); `peak_used`: the most slots in use meanwhile."""
        now = self._clock()
        if now - self._last < self.interval_s:
            return None
        self._last = now
        w, self._window = self._window, _Window()
        if w.replies == 0:
            return None
        queued = w.queued_sum / w.replies
        per_step = w.groups_per_step
        if w.max_rows and queued >= 1.0:
            return self._move(-1, f"engine full ({queued:.1f} requests waiting for a row)")
        if w.buffer_min is not None and w.buffer_min >= FED_STEPS * per_step:
            return self._move(-1, f"trainer has a backlog ({w.buffer_min} groups buffered)")
        if w.buffer_sum / w.replies < per_step and peak_used >= self.limit:
            return self._move(+1, "trainer waits for groups; engine has room")
        self.why = "steady"
        return Decision(self.limit, self.why)

    def _move(self, direction: int, why: str) -> Decision:
        limit = min(max(self.limit + direction * self.group_size, self.floor), self.ceiling)
        if limit == self.limit:
            why += " (at the ceiling)" if direction > 0 else " (at the floor)"
        self.limit, self.why = limit, why
        return Decision(limit, why)
