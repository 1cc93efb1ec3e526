"""A dataset task's rows across its client nodes: each row once per epoch, whoever reads it.

A position is `(epoch, index)`: the `index`-th row of epoch `epoch`'s permutation
(jetctl.envs.dataset.epoch_order, the same on every node). Per task the controller keeps a
cursor (the next position never leased), a pool of positions that came back, and each node's
leases. A client node (jetctl.client.rows) leases a block of positions over `Control.Rows`,
acks each one once its group finished (spooled or dropped: the row was seen), and releases the
ones it will not start (it drains). What a node held returns to the pool when

* the node calls again as `fresh` (it restarted under the same name), or
* it is gone: no longer a node of the run (a swap retired it), exited, or unreachable.

The pool is served before the cursor, so a restart or a swap neither repeats nor skips a row.
The state is written to `RUN_DIR/rows.json` (atomically) when a call changed it, so `up --resume`
goes on where the run stopped, and `jetctl status` shows each task's epoch and position.

    rows = RowLeases(paths.rows)
    lease = rows.lease(request, gone=lambda node: ...)   # Lease(positions, exhausted)

Left out: a node killed after it spooled a group and before its ack reached the controller
(the ack is sent at once, so the window is the time of one RPC) is re-leased that row; the
ack is not yet written in the same transaction as the spooled group.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from jetctl.rundir import read_json, write_json_atomic

Position = tuple[int, int]  # (epoch, index in that epoch's permutation)


class RowsRefused(ValueError):
    """A lease the controller refuses; the message says why and what to do."""


@dataclass(frozen=True)
class RowsCall:
    """One `Control.Rows` request, without grpc (the servicer converts)."""

    name: str
    task: str
    n_rows: int
    epochs: int | None  # None: endless
    want: int
    acked: tuple[Position, ...] = ()
    released: tuple[Position, ...] = ()
    fresh: bool = False


@dataclass(frozen=True)
class Lease:
    positions: list[Position]
    exhausted: bool  # nothing left to lease, now or later


@dataclass
class TaskRows:
    """One task's cursor, pool and leases."""

    n_rows: int
    epochs: int | None
    epoch: int = 0  # the cursor: the next position never leased
    index: int = 0
    pool: list[Position] = field(default_factory=list)  # returned positions, served first
    leases: dict[str, set[Position]] = field(default_factory=dict)  # node -> unacked
    acked: int = 0  # positions acked, all epochs

    @property
    def done(self) -> bool:
        """Every epoch's positions were leased."""
        return self.epochs is not None and self.epoch >= self.epochs

    def take(self) -> Position | None:
        if self.pool:
            return self.pool.pop(0)
        if self.done:
            return None
        position = (self.epoch, self.index)
        self.index += 1
        if self.index >= self.n_rows:
            self.epoch, self.index = self.epoch + 1, 0
        return position

    def give_back(self, positions: Iterable[Position]) -> None:
        self.pool = sorted(set(self.pool) | set(positions))

    def progress(self) -> dict[str, Any]:
        """What `jetctl status` shows: the epoch, the position in it, what is out and back."""
        return {
            "epoch": self.epoch, "position": self.index, "rows": self.n_rows,
            "epochs": self.epochs, "leased": sum(len(h) for h in self.leases.values()),
            "returned": len(self.pool), "acked": self.acked,
        }

    def to_json(self) -> dict[str, Any]:
        return {
            "n_rows": self.n_rows, "epochs": self.epochs, "epoch": self.epoch,
            "index": self.index, "pool": [list(p) for p in self.pool], "acked": self.acked,
            "leases": {n: sorted(list(p) for p in held) for n, held in self.leases.items()},
        }

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> TaskRows:
        return cls(
            n_rows=int(data["n_rows"]), epochs=data["epochs"], epoch=int(data["epoch"]),
            index=int(data["index"]), pool=[(int(e), int(i)) for e, i in data["pool"]],
            leases={n: {(int(e), int(i)) for e, i in held}
                    for n, held in data["leases"].items()},
            acked=int(data["acked"]),
        )


class RowLeases:
    """Every dataset task's rows, under one lock, written to `path` on every change."""

    def __init__(self, path: Path | None) -> None:
        self.path = path
        self._lock = threading.Lock()
        prior = read_json(path) if path is not None else None
        self.tasks: dict[str, TaskRows] = {
            t: TaskRows.from_json(d) for t, d in (prior or {}).get("tasks", {}).items()
        }

    def lease(self, call: RowsCall, gone: Callable[[str], bool]) -> Lease:
        """Reclaim what gone nodes (and this node, when `fresh`) held, apply the acks and
        releases, then lease up to `want` positions: returned ones first."""
        with self._lock:
            rows = self._task(call)
            before = rows.to_json()
            held = rows.leases.setdefault(call.name, set())
            if call.fresh:
                rows.give_back(held)
                held.clear()
            for node in [n for n in rows.leases if n != call.name and gone(n)]:
                rows.give_back(rows.leases.pop(node))
            for position in call.acked:
                if position in held:
                    held.discard(position)
                    rows.acked += 1
                elif position in rows.pool:  # reclaimed while the node finished it: seen
                    rows.pool.remove(position)
                    rows.acked += 1
            rows.give_back(p for p in call.released if p in held)
            held.difference_update(call.released)
            positions: list[Position] = []
            while len(positions) < call.want and (taken := rows.take()) is not None:
                positions.append(taken)
            held.update(positions)
            others = any(h for n, h in rows.leases.items() if n != call.name)
            exhausted = not positions and rows.done and not rows.pool and not others
            if rows.to_json() != before:  # a node waiting for rows changes nothing
                self._save()
        return Lease(positions, exhausted)

    def _task(self, call: RowsCall) -> TaskRows:
        if call.n_rows < 1:
            raise RowsRefused(f"task {call.task}: n_rows must be positive, not {call.n_rows}")
        rows = self.tasks.get(call.task)
        if rows is None:
            rows = self.tasks[call.task] = TaskRows(call.n_rows, call.epochs)
        if rows.n_rows != call.n_rows:
            raise RowsRefused(
                f"task {call.task}: node {call.name} reads {call.n_rows} rows, the run's "
                f"other nodes {rows.n_rows}: every node of a task must read the same dataset"
            )
        rows.epochs = call.epochs  # the recipe's, as edited before `up --resume`
        return rows

    def progress(self) -> dict[str, dict[str, Any]]:
        with self._lock:
            return {t: r.progress() for t, r in self.tasks.items()}

    def _save(self) -> None:
        if self.path is not None:
            write_json_atomic(self.path, {"tasks": {t: r.to_json() for t, r in self.tasks.items()}})
