"""Where a client node's tasks come from: the env's own stream, or rows leased from the run.

    source = task_source(env, link, node="rows-0", task="rows", rng=rng, block=4,
                         stop=draining)
    picked = await source.next()          # Picked(task, position) or None: the stream ended
    source.done(picked, seen=True)        # its group finished (spooled or dropped)
    await source.close()                  # drained: give back what was never started

An env with positions (`n_rows`, `epochs` and `task_at(Position)`: jetctl.envs.dataset) on a
node that has a controller gets `LeasedRows`: it leases `block` positions at a time over
`Control.Rows` (jetctl.controller.rows), acks each one as its group finishes (at once, in
the background, coalesced into one call at a time) and releases the rows it did not start
when it drains; its first call is `fresh`, so what an earlier process of the same node held
returns to the pool. Any other env, or a node without a controller, gets `EnvStream`: the
env's `tasks(rng)`. A lease costs one loopback RPC per `block` groups, off no rollout's path.
"""

from __future__ import annotations

import asyncio
import logging
import random
from collections import deque
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any, Protocol

import grpc

from jetctl.env import Position, Task
from jetctl.link import ControlLink
from jetctl.proto._gen import control_pb2 as cpb

log = logging.getLogger(__name__)

RETRY_S = 1.0  # between calls while the controller does not answer, or others hold the rest


class RowsError(RuntimeError):
    """The controller refused this node's lease (e.g. its dataset differs from the others')."""


@dataclass(frozen=True)
class Picked:
    task: Task
    position: Position | None  # None: the env's own stream


class TaskSource(Protocol):
    async def next(self) -> Picked | None: ...

    def done(self, picked: Picked, seen: bool) -> None: ...

    async def close(self) -> None: ...


class EnvStream:
    """The env's `tasks(rng)`, for envs without positions or a node without a controller."""

    def __init__(self, tasks: Iterator[Task]) -> None:
        self._tasks = tasks

    async def next(self) -> Picked | None:
        task = next(self._tasks, None)
        return None if task is None else Picked(task, None)

    def done(self, picked: Picked, seen: bool) -> None:
        pass

    async def close(self) -> None:
        pass


class LeasedRows:
    """Positions leased from the controller; see the module docstring."""

    def __init__(
        self, env: Any, link: ControlLink, node: str, task: str, block: int,
        stop: asyncio.Event,
    ) -> None:
        self.env = env
        self._stop = stop  # the node drains: stop waiting for rows others hold
        self.link = link
        self.node = node
        self.task = task
        self.block = max(1, block)
        self._buffer: deque[Position] = deque()  # leased, not started
        self._acked: list[Position] = []  # finished, not yet told
        self._released: list[Position] = []  # leased, given back, not yet told
        self._fresh = True
        self._call_lock = asyncio.Lock()
        self._flush: asyncio.Task[None] | None = None

    async def next(self) -> Picked | None:
        while not self._buffer:
            reply = await self._call(want=self.block)
            self._buffer.extend(Position(int(p.epoch), int(p.index)) for p in reply.rows)
            if not self._buffer:
                if reply.exhausted:
                    return None
                # others hold the last rows; some may come back (unless this node drains)
                try:
                    await asyncio.wait_for(self._stop.wait(), timeout=RETRY_S)
                except asyncio.TimeoutError:
                    continue
                return None
        position = self._buffer.popleft()
        return Picked(self.env.task_at(position), position)

    def done(self, picked: Picked, seen: bool) -> None:
        """A group finished (`seen`) or was cancelled before it ran (given back)."""
        if picked.position is None:
            return
        (self._acked if seen else self._released).append(picked.position)
        if self._flush is None or self._flush.done():
            self._flush = asyncio.create_task(self._call_until_told())

    async def close(self) -> None:
        """Give back what was leased and never started; tell the acks still pending."""
        self._released.extend(self._buffer)
        self._buffer.clear()
        if self._flush is not None:
            await self._flush
        if self._acked or self._released:
            await self._call_until_told()

    async def _call_until_told(self) -> None:
        while self._acked or self._released:
            try:
                await self._call(want=0)
            except RowsError:
                log.exception("the controller refused this node's row acks")
                return

    async def _call(self, want: int) -> cpb.RowsReply:
        """One Rows call carrying every pending ack and release; retried while the
        controller does not answer (they stay pending until one gets through)."""
        async with self._call_lock:
            while True:
                acked, released = list(self._acked), list(self._released)
                request = cpb.RowsRequest(
                    name=self.node, task=self.task, n_rows=self.env.n_rows,
                    epochs=self.env.epochs or 0, want=want, fresh=self._fresh,
                    acked=[cpb.RowPosition(epoch=p.epoch, index=p.index) for p in acked],
                    released=[cpb.RowPosition(epoch=p.epoch, index=p.index) for p in released],
                )
                try:
                    reply = await self.link.rows(request)
                except grpc.aio.AioRpcError as e:
                    if e.code() == grpc.StatusCode.FAILED_PRECONDITION:
                        raise RowsError(e.details() or "the controller refused the lease") from None
                    log.warning("rows of %s: controller not answering (%s); retrying",
                                self.task, e.code().name)
                    await asyncio.sleep(RETRY_S)
                    continue
                self._fresh = False
                del self._acked[:len(acked)]
                del self._released[:len(released)]
                return reply


def has_positions(env: Any) -> bool:
    return all(hasattr(env, a) for a in ("n_rows", "epochs", "task_at"))


def task_source(
    env: Any, link: ControlLink | None, *, node: str, task: str, rng: random.Random, block: int,
    stop: asyncio.Event, leased: bool = True,
) -> TaskSource:
    """`LeasedRows` for an env with positions on a node with a controller, else `EnvStream`.
    `stop` set (the node drains) ends a wait for rows that other nodes hold. `leased=False`
    (run.deterministic): always `EnvStream`, so a dataset's rows come in the order `rng`
    draws, not in the order the run's nodes happen to ask for them."""
    if leased and link is not None and has_positions(env):
        return LeasedRows(env, link, node, task, block, stop)
    return EnvStream(iter(env.tasks(rng)))
