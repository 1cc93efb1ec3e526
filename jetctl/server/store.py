"""Durable trajectory store of one swarm server (sqlite, WAL, synchronous=FULL).

Every group the server answers for is a row: `buffered` (accepted, waiting to be trained),
`trained` (with the step that used it) or `rejected` (with a reason). A group is acked only
after its row is committed, so an ack survives kill -9. Writes from concurrent Submit calls
are committed together by one writer thread (group commit): one fsync covers many groups.

Duplicates are recognised by group id across restarts: a resubmitted group gets its
recorded outcome again (DUPLICATE if it was accepted, its rejection otherwise).

For the ledger (`jetctl.ledger`) each row keeps its trajectory ids, and two append-only
tables keep the history: `epochs` (one row per `open`, with the checkpoint version it
resumed from) and `train_log` (group, step, epoch for every `mark_trained`). Steps of an
epoch past the version the next epoch resumed from were lost with the crash; what survives
must train each group at most once.

Left out: a remote (fsspec) store; the buffer of accepted groups is held in memory too,
bounded by `max_buffer_groups` (oldest are rejected as stale first by the trainer).
"""

from __future__ import annotations

import math
import queue
import sqlite3
import threading
import time
from collections import deque
from concurrent.futures import Future
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

from jetctl.types import TrajectoryGroup

Outcome = Literal["accepted", "duplicate", "stale", "invalid", "revision"]

SCHEMA = """
CREATE TABLE IF NOT EXISTS groups (
    id TEXT PRIMARY KEY,
    task TEXT NOT NULL,
    n_traj INTEGER NOT NULL,
    min_version INTEGER NOT NULL,
    state TEXT NOT NULL,            -- buffered | trained | rejected
    reason TEXT NOT NULL DEFAULT '',
    step INTEGER,                   -- the optimizer step that trained it
    received_at REAL NOT NULL,
    payload BLOB,                   -- serialized TrajectoryGroup (dropped once trained)
    trajectory_ids TEXT NOT NULL DEFAULT '',  -- comma-separated, for the ledger
    revisions TEXT NOT NULL DEFAULT '', -- the trajectories' client_revision, comma-separated
    reward_sum REAL NOT NULL DEFAULT 0  -- sum of the trajectories' rewards (per-task figures)
);
CREATE INDEX IF NOT EXISTS groups_state ON groups(state);
CREATE TABLE IF NOT EXISTS epochs (
    epoch INTEGER PRIMARY KEY,      -- 1, 2, ...: one per server start
    resumed_from INTEGER NOT NULL,  -- the checkpoint version it restored
    started_at REAL NOT NULL
);
CREATE TABLE IF NOT EXISTS train_log (
    group_id TEXT NOT NULL,
    step INTEGER NOT NULL,
    epoch INTEGER NOT NULL
);
"""


@dataclass
class StoredGroup:
    group: TrajectoryGroup
    received_at: float


@dataclass(frozen=True)
class PutResult:
    outcome: Outcome
    reason: str = ""


@dataclass
class _PutRequest:
    group: TrajectoryGroup
    payload: bytes
    outcome: Outcome  # what to record when new: accepted | stale | revision
    reason: str
    future: Future[PutResult]


class TrajectoryStore:
    """Durable store + in-memory buffer of accepted, untrained groups."""

    def __init__(self, path: Path, *, decode: GroupCodec) -> None:
        self.path = path
        self._codec = decode
        path.parent.mkdir(parents=True, exist_ok=True)
        self._db = sqlite3.connect(path, check_same_thread=False, isolation_level=None)
        self._db.execute("PRAGMA journal_mode=WAL")
        self._db.execute("PRAGMA synchronous=FULL")
        self._db.executescript(SCHEMA)
        have = {r[1] for r in self._db.execute("PRAGMA table_info(groups)")}
        if "trajectory_ids" not in have:  # a store written before the column existed
            self._db.execute(
                "ALTER TABLE groups ADD COLUMN trajectory_ids TEXT NOT NULL DEFAULT ''"
            )
        if "revisions" not in have:  # a store written before swaps recorded revisions
            self._db.execute("ALTER TABLE groups ADD COLUMN revisions TEXT NOT NULL DEFAULT ''")
        if "reward_sum" not in have:  # a store written before per-task rewards
            self._db.execute("ALTER TABLE groups ADD COLUMN reward_sum REAL NOT NULL DEFAULT 0")
        self.epoch = 0
        self._db_lock = threading.Lock()
        self._buffer: deque[StoredGroup] = deque()
        self._buffer_cond = threading.Condition()
        self._queue: queue.Queue[_PutRequest | None] = queue.Queue()
        self._writer = threading.Thread(target=self._write_loop, name="store-writer", daemon=True)
        self._closed = False

    # --- lifecycle -------------------------------------------------------------------

    def open(self, trained_through_step: int) -> int:
        """Reload the buffer; groups trained after the restored checkpoint go back to it.

        A group marked trained at a step later than the checkpoint we resumed from was
        never seen by the restored weights, so it is buffered again (trained once in the
        surviving model's history). Returns how many groups are buffered.
        """
        with self._db_lock:
            self._db.execute("BEGIN IMMEDIATE")
            self._db.execute(
                "UPDATE groups SET state='buffered', step=NULL WHERE state='trained' AND step > ?",
                (trained_through_step,),
            )
            last = self._db.execute("SELECT COALESCE(MAX(epoch), 0) FROM epochs").fetchone()[0]
            self.epoch = int(last) + 1
            self._db.execute(
                "INSERT INTO epochs (epoch, resumed_from, started_at) VALUES (?, ?, ?)",
                (self.epoch, trained_through_step, time.time()),
            )
            self._db.execute("COMMIT")
            rows = self._db.execute(
                "SELECT payload, received_at FROM groups WHERE state='buffered' "
                "ORDER BY received_at"
            ).fetchall()
        with self._buffer_cond:
            self._buffer.clear()
            for payload, received_at in rows:
                self._buffer.append(StoredGroup(self._codec.decode(payload), received_at))
        self._writer.start()
        return len(rows)

    def close(self) -> None:
        if not self._closed:
            self._closed = True
            self._queue.put(None)
            if self._writer.is_alive():
                self._writer.join(timeout=10)
            with self._buffer_cond:
                self._buffer_cond.notify_all()
            self._db.close()

    # --- writes ----------------------------------------------------------------------

    def put(
        self, group: TrajectoryGroup, payload: bytes, outcome: Outcome = "accepted", reason: str = ""
    ) -> Future[PutResult]:
        """Record a group; the future resolves once committed (or found as a duplicate)."""
        fut: Future[PutResult] = Future()
        self._queue.put(_PutRequest(group, payload, outcome, reason, fut))
        return fut

    def _write_loop(self) -> None:
        while True:
            first = self._queue.get()
            if first is None:
                return
            batch = [first]
            while len(batch) < 512:
                try:
                    nxt = self._queue.get_nowait()
                except queue.Empty:
                    break
                if nxt is None:
                    self._queue.put(None)  # finish this batch, then stop
                    break
                batch.append(nxt)
            self._commit(batch)

    def _commit(self, batch: list[_PutRequest]) -> None:
        results: list[PutResult] = []
        accepted: list[StoredGroup] = []
        now = time.time()
        try:
            with self._db_lock:
                self._db.execute("BEGIN IMMEDIATE")
                for req in batch:
                    g = req.group
                    row = self._db.execute(
                        "SELECT state, reason FROM groups WHERE id=?", (g.id,)
                    ).fetchone()
                    if row is not None:
                        results.append(_recorded_outcome(row[0], row[1]))
                        continue
                    state = "buffered" if req.outcome == "accepted" else "rejected"
                    reason = req.reason if state == "rejected" else ""
                    if state == "rejected" and not reason:
                        reason = req.outcome
                    self._db.execute(
                        "INSERT INTO groups (id, task, n_traj, min_version, state, reason, "
                        "received_at, payload, trajectory_ids, revisions, reward_sum) "
                        "VALUES (?,?,?,?,?,?,?,?,?,?,?)",
                        (
                            g.id,
                            g.task,
                            len(g.trajectories),
                            g.min_version,
                            state,
                            reason,
                            now,
                            req.payload if state == "buffered" else None,
                            ",".join(t.id for t in g.trajectories),
                            ",".join(sorted({t.client_revision for t in g.trajectories})),
                            math.fsum(t.reward for t in g.trajectories),
                        ),
                    )
                    results.append(PutResult(req.outcome, req.reason))
                    if state == "buffered":
                        accepted.append(StoredGroup(g, now))
                self._db.execute("COMMIT")
        except sqlite3.Error as exc:
            with self._db_lock:
                if self._db.in_transaction:
                    self._db.execute("ROLLBACK")
            for req in batch:
                if not req.future.cancelled():
                    req.future.set_exception(exc)
            return
        if accepted:
            with self._buffer_cond:
                self._buffer.extend(accepted)
                self._buffer_cond.notify_all()
        for req, res in zip(batch, results):
            # a caller that gave up (its Submit was cancelled at its deadline) cancelled the
            # future; the row is committed all the same and a resend hears DUPLICATE. Setting
            # a cancelled future raises, which killed this thread and stalled every Submit.
            if not req.future.cancelled():
                req.future.set_result(res)

    def recorded(self, group_id: str) -> PutResult | None:
        """The outcome a group already stored would get again (None: never stored)."""
        with self._db_lock:
            row = self._db.execute(
                "SELECT state, reason FROM groups WHERE id=?", (group_id,)
            ).fetchone()
        return None if row is None else _recorded_outcome(row[0], row[1])

    # --- the trainer's side ----------------------------------------------------------

    def take(self, n: int, timeout_s: float) -> list[StoredGroup]:
        """Up to n buffered groups, oldest first; waits up to timeout_s for the first n."""
        deadline = time.monotonic() + timeout_s
        with self._buffer_cond:
            while len(self._buffer) < n and not self._closed:
                left = deadline - time.monotonic()
                if left <= 0:
                    break
                self._buffer_cond.wait(left)
            taken = [self._buffer.popleft() for _ in range(min(n, len(self._buffer)))]
        return taken

    def give_back(self, groups: list[StoredGroup]) -> None:
        """Return groups that were taken but not trained (front of the queue, same order)."""
        with self._buffer_cond:
            self._buffer.extendleft(reversed(groups))
            self._buffer_cond.notify_all()

    def mark_trained(self, group_ids: list[str], step: int) -> None:
        with self._db_lock:
            self._db.execute("BEGIN IMMEDIATE")
            self._db.executemany(
                "UPDATE groups SET state='trained', step=? WHERE id=?",
                [(step, gid) for gid in group_ids],
            )
            self._db.executemany(
                "INSERT INTO train_log (group_id, step, epoch) VALUES (?, ?, ?)",
                [(gid, step, self.epoch) for gid in group_ids],
            )
            self._db.execute("COMMIT")

    def forget_payloads(self, through_step: int) -> None:
        """Drop payloads of groups trained at or before a completed checkpoint's step.

        Until then a trained group keeps its payload: a crash before the next checkpoint
        loses those steps, and open() buffers such groups again.
        """
        with self._db_lock:
            self._db.execute(
                "UPDATE groups SET payload=NULL WHERE state='trained' AND step <= ? "
                "AND payload IS NOT NULL",
                (through_step,),
            )

    def mark_rejected(self, group_ids: list[str], reason: str) -> None:
        with self._db_lock:
            self._db.execute("BEGIN IMMEDIATE")
            self._db.executemany(
                "UPDATE groups SET state='rejected', reason=?, payload=NULL WHERE id=?",
                [(reason, gid) for gid in group_ids],
            )
            self._db.execute("COMMIT")

    # --- figures ---------------------------------------------------------------------

    @property
    def buffer_depth(self) -> int:
        return len(self._buffer)

    def counts(self) -> dict[str, dict[str, int]]:
        """Trajectory and group counts by state (and by rejection reason)."""
        with self._db_lock:
            rows = self._db.execute(
                "SELECT state, reason, COUNT(*), SUM(n_traj) FROM groups GROUP BY state, reason"
            ).fetchall()
        groups: dict[str, int] = {}
        trajs: dict[str, int] = {}
        for state, reason, n_groups, n_traj in rows:
            key = f"rejected:{reason}" if state == "rejected" else state
            groups[key] = groups.get(key, 0) + int(n_groups)
            trajs[key] = trajs.get(key, 0) + int(n_traj or 0)
        return {"groups": groups, "trajectories": trajs}

    def received_by_task(self) -> dict[str, int]:
        with self._db_lock:
            rows = self._db.execute(
                "SELECT task, SUM(n_traj) FROM groups GROUP BY task"
            ).fetchall()
        return {task: int(n or 0) for task, n in rows}

    def reward_by_task(self, last_groups: int = 32) -> dict[str, float]:
        """Mean trajectory reward of each task's last `last_groups` accepted groups."""
        with self._db_lock:
            rows = self._db.execute(
                "SELECT task, SUM(reward_sum) / SUM(n_traj) FROM ("
                "  SELECT task, reward_sum, n_traj, ROW_NUMBER() OVER "
                "    (PARTITION BY task ORDER BY received_at DESC, rowid DESC) AS rn"
                "  FROM groups WHERE state != 'rejected'"
                ") WHERE rn <= ? GROUP BY task",
                (last_groups,),
            ).fetchall()
        return {task: float(mean) for task, mean in rows if mean is not None}


class GroupCodec:
    """Turns stored payload bytes back into TrajectoryGroups (protobuf, via jetctl.proto)."""

    def decode(self, payload: bytes) -> TrajectoryGroup:
        from jetctl.proto._gen import swarm_pb2
        from jetctl.proto.convert import group_from_pb

        return group_from_pb(swarm_pb2.TrajectoryGroup.FromString(payload))


def _recorded_outcome(state: str, reason: str) -> PutResult:
    if state == "rejected":
        code = reason.split(":", 1)[0]
        if code in ("stale", "invalid", "revision"):
            return PutResult(code, reason)  # type: ignore[arg-type]
        return PutResult("invalid", reason)
    return PutResult("duplicate", "")
