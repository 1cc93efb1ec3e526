"""The turn barrier of an in-process batch of rollouts: each rollout runs in a thread of its
own and parks its model call here; once every live rollout has parked one, the main thread
takes them all and answers them together (one `model.generate` per turn over the batch).

    barrier = TurnBarrier[Call](len(rollouts))
    # in each rollout thread:   reply = barrier.ask(call) ... barrier.finished()
    # in the main thread:
    while (calls := barrier.next_turn()) is not None:
        ...generate, fill each call's reply...; call.done.set() for each

`jetctl eval` (jetctl/run/eval.py) and the baseline loop of `jetctl bench loop`
(jetctl/bench/sync_loop.py) batch their calls through it. Left out: timeouts (a rollout that
never parks or finishes holds the turn forever) and the call's contents, which are the
caller's own (anything with a `done` event).
"""

from __future__ import annotations

import threading
from typing import Generic, Protocol, TypeVar


class Parked(Protocol):
    done: threading.Event  # set by the main thread once the call is answered


CallT = TypeVar("CallT", bound=Parked)


class TurnBarrier(Generic[CallT]):
    """`rollouts` threads park their calls; the main thread takes a turn's calls once every
    rollout still running has parked one."""

    def __init__(self, rollouts: int) -> None:
        self._cond = threading.Condition()
        self._pending: list[CallT] = []
        self._live = rollouts

    def ask(self, call: CallT) -> CallT:
        """Park `call` (from a rollout thread) and wait until the main thread answers it."""
        with self._cond:
            self._pending.append(call)
            self._cond.notify_all()
        call.done.wait()
        return call

    def finished(self) -> None:
        """A rollout ended (also by raising): the turns stop waiting for it."""
        with self._cond:
            self._live -= 1
            self._cond.notify_all()

    def next_turn(self) -> list[CallT] | None:
        """The calls of the next turn, once every live rollout waits; None when all ended."""
        with self._cond:
            self._cond.wait_for(lambda: len(self._pending) == self._live)
            if self._live == 0:
                return None
            calls, self._pending = self._pending, []
            return calls
