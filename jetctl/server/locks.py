"""The lock on a server's model weights, shared by the trainer and the engine.

The optimizer step, checkpoints and weight snapshots take it; a generating engine holds it
while any reply is in flight, so that every reply comes from one model version. It is a
`threading.Lock` that also counts who waits for it: a continuous-batching engine, which
could otherwise keep the weights forever under steady load, stops admitting new requests
as soon as someone waits, finishes the replies in flight and lets go.
"""

from __future__ import annotations

import threading
from types import TracebackType

from typing_extensions import Self


class WeightsLock:
    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._count = threading.Lock()
        self._waiting = 0

    def acquire(self, blocking: bool = True, timeout: float = -1) -> bool:
        with self._count:
            self._waiting += 1
        try:
            return self._lock.acquire(blocking, timeout)
        finally:
            with self._count:
                self._waiting -= 1

    def release(self) -> None:
        self._lock.release()

    def locked(self) -> bool:
        return self._lock.locked()

    @property
    def waiting(self) -> int:
        """How many threads are blocked in `acquire` right now."""
        return self._waiting

    def __enter__(self) -> Self:
        self.acquire()
        return self

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.release()
