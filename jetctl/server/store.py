"""Durable trajectory store of one swarm server (sqlite, WAL, synchronous=FULL).

Every group the server answers for is a row: `buffered` (accepted, waiting to be trained),
`trained` (with the step that used it) or `rejected` (its `refusal`: stale | invalid |
revision, and a free-text `reason` for people). A group is acked only after its row is
committed, so an ack survives kill -9. Writes from concurrent Submit calls are committed
together by one writer thread (group commit): one fsync covers many groups, and the groups
of one Submit (`put_many`) share one future, resolved once for all of them.

A group is kept as the bytes it arrived in (its `TrajectoryGroup` protobuf, sliced out of
the Submit request): admission reads the message in place, the store writes those bytes and
a few facts (`GroupFacts`), and only the trainer decodes a group, when it trains it
(`StoredGroup.group`).

Duplicates are recognised by group id across restarts: a resubmitted group gets its
recorded outcome again (DUPLICATE if it was accepted, its refusal otherwise).

The in-memory buffer of accepted, untrained groups holds at most `max_buffer_groups`, and at
most `max_buffer_bytes` of payload; a new group that would pass either is not stored and gets
`busy` (Ack BUSY): the client keeps it in its spool and resends it later, so back-pressure
loses nothing. (A group no larger than `max_buffer_bytes` always fits an empty buffer; the
recipe keeps it at least `limits.max_message_bytes`.)

For the ledger (`jetctl.run.ledger`) each row keeps its trajectory ids, and two append-only
tables keep the history: `epochs` (one row per `open`, with the checkpoint version it
resumed from) and `train_log` (group, step, epoch for every `mark_trained`). Steps of an
epoch past the version the next epoch resumed from were lost with the crash; what survives
must train each group at most once.

The figures Status reads (`counts`, `received_by_task`, `reward_by_task`) are running
counters (`_Tally`), read from the table once at start and kept as groups are committed,
trained and rejected: a Status costs the same on a run's first day as on its tenth, and
never waits for the writer's lock (a scan of the whole table under it, once a second, made
Submit latency grow with the run's age).

Left out: a remote (fsspec) store.
"""

from __future__ import annotations

import itertools
import math
import queue
import sqlite3
import threading
import time
from collections import deque
from collections.abc import Collection, Iterable
from concurrent.futures import Future
from dataclasses import dataclass
from functools import cached_property
from pathlib import Path
from typing import Any, Literal, cast

from jetctl.types import TrajectoryGroup

Outcome = Literal["accepted", "duplicate", "stale", "invalid", "revision", "busy"]
Refusal = Literal["stale", "invalid", "revision"]
REFUSALS: tuple[Refusal, ...] = ("stale", "invalid", "revision")
MAX_BATCH = 512  # puts committed in one transaction at most
DEFAULT_MAX_BUFFER_BYTES = 1 << 30  # limits.max_buffer_bytes's default
REWARD_WINDOW = 32  # groups: reward_by_task is the mean of each task's last ones

SCHEMA = """
CREATE TABLE IF NOT EXISTS groups (
    id TEXT PRIMARY KEY,
    task TEXT NOT NULL,
    n_traj INTEGER NOT NULL,
    min_version INTEGER NOT NULL,
    state TEXT NOT NULL,            -- buffered | trained | rejected
    reason TEXT NOT NULL DEFAULT '', -- free text for people; never parsed
    step INTEGER,                   -- the optimizer step that trained it
    received_at REAL NOT NULL,
    payload BLOB,                   -- the TrajectoryGroup protobuf as received (dropped after training: forget_payloads)
    trajectory_ids TEXT NOT NULL DEFAULT '',  -- comma-separated, for the ledger
    revisions TEXT NOT NULL DEFAULT '', -- the trajectories' client_revision, comma-separated
    reward_sum REAL NOT NULL DEFAULT 0, -- sum of the trajectories' rewards (per-task figures)
    refusal TEXT NOT NULL DEFAULT ''    -- stale | invalid | revision when state = 'rejected'
);
CREATE INDEX IF NOT EXISTS groups_state ON groups(state);
-- the groups that still hold a payload, by step: forget_payloads reads these only, not
-- every trained group of the run (a scan that took 0.44 s a checkpoint at 440k groups)
CREATE INDEX IF NOT EXISTS groups_unforgotten ON groups(step) WHERE payload IS NOT NULL;
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

# Stores written before `refusal` had a column kept the code only as the reason's prefix
# ("stale: lag 3 > 2"). Read it once, here, when the column is added; nothing parses
# reasons afterwards.
MIGRATE_REFUSAL = """
UPDATE groups SET refusal = CASE
    WHEN reason LIKE 'stale%' THEN 'stale'
    WHEN reason LIKE 'revision%' THEN 'revision'
    ELSE 'invalid' END
WHERE state = 'rejected'
"""


@dataclass(frozen=True)
class GroupFacts:
    """What the store records about a group beside its bytes (one pass over the group)."""

    id: str
    task: str
    n_trajectories: int
    min_version: int
    trajectory_ids: tuple[str, ...]
    revisions: tuple[str, ...]  # distinct client revisions, sorted
    reward_sum: float

    @classmethod
    def of(cls, group: Any) -> GroupFacts:
        """Read the facts of a `TrajectoryGroup` dataclass or protobuf message alike."""
        trajs = group.trajectories
        versions = [c.model_version for t in trajs for c in t.calls]
        return cls(
            id=group.id,
            task=group.task,
            n_trajectories=len(trajs),
            min_version=min(versions, default=-1),
            trajectory_ids=tuple(t.id for t in trajs),
            revisions=tuple(sorted({t.client_revision for t in trajs})),
            reward_sum=math.fsum(t.reward for t in trajs),
        )

    def lag(self, server_version: int) -> int:
        """server_version - min(call versions), as `TrajectoryGroup.lag`."""
        return server_version - self.min_version


@dataclass(eq=False)
class StoredGroup:
    """An accepted group in the buffer: its facts and its bytes; decoded on first use."""

    facts: GroupFacts
    payload: bytes
    received_at: float

    @property
    def id(self) -> str:
        return self.facts.id

    @cached_property
    def group(self) -> TrajectoryGroup:
        """The decoded group (in the trainer's thread: the Submit path never decodes)."""
        from jetctl.proto.convert import group_from_bytes

        return group_from_bytes(self.payload)


@dataclass(frozen=True)
class PutResult:
    outcome: Outcome
    reason: str = ""


@dataclass(frozen=True)
class StoreCounts:
    """Groups and trajectories by state; the rejected ones by refusal."""

    groups: dict[str, int]  # buffered | trained -> groups
    trajectories: dict[str, int]
    rejected_groups: dict[str, int]  # stale | invalid | revision -> groups
    rejected_trajectories: dict[str, int]


@dataclass(frozen=True)
class Put:
    """A group to record: its facts, its bytes, and what to record when its id is new."""

    facts: GroupFacts
    payload: bytes
    outcome: Outcome = "accepted"  # accepted | stale | revision
    reason: str = ""


@dataclass
class _PutRequest:
    puts: list[Put]
    future: Future[list[PutResult]]


class _Tally:
    """Running counts of the store's rows, kept as they change (see the module docstring).

    Updated after each commit that changes them, under a lock of its own that is held for a
    few dict updates: readers never wait for a transaction."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._by_state: dict[tuple[str, str], list[int]] = {}  # (state, refusal) -> [groups, trajs]
        self._received: dict[str, int] = {}  # task -> trajectories
        # task -> its last REWARD_WINDOW groups not rejected: (group id, reward sum, trajectories)
        self._recent: dict[str, deque[tuple[str, float, int]]] = {}

    def load(self, db: sqlite3.Connection) -> None:
        """Read the counts from the table (at start: the only full scans)."""
        by_state = {
            (state, refusal): [int(g), int(t or 0)]
            for state, refusal, g, t in db.execute(
                "SELECT state, refusal, COUNT(*), SUM(n_traj) FROM groups GROUP BY state, refusal"
            )
        }
        received = {
            task: int(n or 0)
            for task, n in db.execute("SELECT task, SUM(n_traj) FROM groups GROUP BY task")
        }
        recent: dict[str, deque[tuple[str, float, int]]] = {}
        for gid, task, reward_sum, n in db.execute(
            "SELECT id, task, reward_sum, n_traj FROM ("
            "  SELECT id, task, reward_sum, n_traj, received_at, rowid AS r, ROW_NUMBER() OVER "
            "    (PARTITION BY task ORDER BY received_at DESC, rowid DESC) AS rn"
            "  FROM groups WHERE state != 'rejected'"
            ") WHERE rn <= ? ORDER BY received_at, r",
            (REWARD_WINDOW,),
        ):
            recent.setdefault(task, deque(maxlen=REWARD_WINDOW)).append((gid, reward_sum, n))
        with self._lock:
            self._by_state, self._received, self._recent = by_state, received, recent

    def added(self, rows: list[tuple[str, str, str, str, int, float]]) -> None:
        """New rows: (id, task, state, refusal, trajectories, reward sum) each."""
        with self._lock:
            for gid, task, state, refusal, n, reward_sum in rows:
                counts = self._by_state.setdefault((state, refusal), [0, 0])
                counts[0] += 1
                counts[1] += n
                self._received[task] = self._received.get(task, 0) + n
                if state != "rejected":
                    self._recent.setdefault(task, deque(maxlen=REWARD_WINDOW)).append(
                        (gid, reward_sum, n)
                    )

    def moved(
        self, rows: list[tuple[str, str, str, str, int]], state: str, refusal: str = ""
    ) -> None:
        """Rows (id, task, old state, old refusal, trajectories) now in `state` (`refusal`)."""
        with self._lock:
            for gid, task, old, old_refusal, n in rows:
                before = self._by_state[(old, old_refusal)]
                before[0] -= 1
                before[1] -= n
                after = self._by_state.setdefault((state, refusal), [0, 0])
                after[0] += 1
                after[1] += n
                if state == "rejected" and task in self._recent:
                    kept = [r for r in self._recent[task] if r[0] != gid]
                    self._recent[task] = deque(kept, maxlen=REWARD_WINDOW)

    def counts(self) -> StoreCounts:
        out = StoreCounts({}, {}, {}, {})
        with self._lock:
            for (state, refusal), (n_groups, n_traj) in self._by_state.items():
                if n_groups == 0:
                    continue
                groups, trajs = (
                    (out.rejected_groups, out.rejected_trajectories)
                    if state == "rejected" else (out.groups, out.trajectories)
                )
                key = refusal if state == "rejected" else state
                groups[key] = groups.get(key, 0) + n_groups
                trajs[key] = trajs.get(key, 0) + n_traj
        return out

    def received_by_task(self) -> dict[str, int]:
        with self._lock:
            return dict(self._received)

    def reward_by_task(self, last_groups: int) -> dict[str, float]:
        out = {}
        with self._lock:
            for task, recent in self._recent.items():
                last = list(recent)[-last_groups:]
                n = sum(r[2] for r in last)
                if n:
                    out[task] = sum(r[1] for r in last) / n
        return out


class TrajectoryStore:
    """Durable store + in-memory buffer of accepted, untrained groups."""

    def __init__(
        self, path: Path, *, max_buffer_groups: int = 1024,
        max_buffer_bytes: int = DEFAULT_MAX_BUFFER_BYTES,
    ) -> None:
        if max_buffer_groups < 1:
            raise ValueError(f"max_buffer_groups ({max_buffer_groups}) must be at least 1")
        if max_buffer_bytes < 1:
            raise ValueError(f"max_buffer_bytes ({max_buffer_bytes}) must be at least 1")
        self.path = path
        self.max_buffer_groups = max_buffer_groups
        self.max_buffer_bytes = max_buffer_bytes
        path.parent.mkdir(parents=True, exist_ok=True)
        self._db = sqlite3.connect(path, check_same_thread=False, isolation_level=None)
        self._db.execute("PRAGMA journal_mode=WAL")
        self._db.execute("PRAGMA synchronous=FULL")
        self._db.executescript(SCHEMA)
        self._migrate()
        self._tally = _Tally()
        self._tally.load(self._db)
        self.epoch = 0
        self._db_lock = threading.Lock()
        self._buffer: deque[StoredGroup] = deque()
        self._buffer_bytes = 0  # payload bytes in _buffer (changed under _buffer_cond)
        self._buffer_cond = threading.Condition()
        self._queue: queue.Queue[_PutRequest | None] = queue.Queue()
        self._writer = threading.Thread(target=self._write_loop, name="store-writer", daemon=True)
        self._closed = False

    def _migrate(self) -> None:
        """Bring a store written by an older jetctl up to this schema (in place)."""
        have = {r[1] for r in self._db.execute("PRAGMA table_info(groups)")}
        added = {
            "trajectory_ids": "TEXT NOT NULL DEFAULT ''",  # before the ledger
            "revisions": "TEXT NOT NULL DEFAULT ''",  # before swaps recorded revisions
            "reward_sum": "REAL NOT NULL DEFAULT 0",  # before per-task rewards
            "refusal": "TEXT NOT NULL DEFAULT ''",  # before refusals had a column
        }
        for column, decl in added.items():
            if column not in have:
                self._db.execute("BEGIN IMMEDIATE")
                self._db.execute(f"ALTER TABLE groups ADD COLUMN {column} {decl}")
                if column == "refusal":
                    self._db.execute(MIGRATE_REFUSAL)
                self._db.execute("COMMIT")

    # --- lifecycle -------------------------------------------------------------------

    def open(self, trained_through_step: int) -> int:
        """Reload the buffer; groups trained after the restored checkpoint go back to it.

        A group marked trained at a step later than the checkpoint we resumed from was
        never seen by the restored weights, so it is buffered again (trained once in the
        surviving model's history). Returns how many groups are buffered (this may pass
        `max_buffer_groups`: then new groups are refused as busy until it drains).
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
            self._tally.load(self._db)  # groups went back to the buffer
            rows = self._db.execute(
                "SELECT id, task, n_traj, min_version, trajectory_ids, revisions, reward_sum, "
                "payload, received_at FROM groups WHERE state='buffered' ORDER BY received_at"
            ).fetchall()
        with self._buffer_cond:
            self._buffer.clear()
            for gid, task, n, min_version, ids, revisions, reward_sum, payload, at in rows:
                facts = GroupFacts(
                    id=gid, task=task, n_trajectories=n, min_version=min_version,
                    trajectory_ids=tuple(ids.split(",")) if ids else (),
                    revisions=tuple(revisions.split(",")) if revisions else (),
                    reward_sum=reward_sum,
                )
                self._buffer.append(StoredGroup(facts, payload, at))
            self._buffer_bytes = sum(len(s.payload) for s in self._buffer)
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
        self,
        group: GroupFacts | Any,
        payload: bytes,
        outcome: Outcome = "accepted",
        reason: str = "",
    ) -> Future[PutResult]:
        """Record a group; the future resolves once committed (or found as a duplicate).

        `group` is its `GroupFacts` (the server's path: admission read them in its one
        pass), or a group (dataclass or protobuf) to read them from. `payload` is the
        group's protobuf bytes; `outcome` what to record when the id is new: accepted,
        stale or revision. An accepted group that would pass `max_buffer_groups` is not
        stored: it resolves to `busy`, to be sent again later."""
        facts = group if isinstance(group, GroupFacts) else GroupFacts.of(group)
        many = self.put_many([Put(facts, payload, outcome, reason)])
        one: Future[PutResult] = Future()

        def resolve(done: Future[list[PutResult]]) -> None:
            if one.cancelled():
                return
            exc = done.exception()
            if exc is not None:
                one.set_exception(exc)
            else:
                one.set_result(done.result()[0])

        many.add_done_callback(resolve)
        return one

    def put_many(self, puts: list[Put]) -> Future[list[PutResult]]:
        """Record groups (a Submit's); one future resolves, once all are committed, to each
        one's result in order."""
        fut: Future[list[PutResult]] = Future()
        self._queue.put(_PutRequest(puts, fut))
        return fut

    def _write_loop(self) -> None:
        while True:
            first = self._queue.get()
            if first is None:
                return
            batch = [first]
            n_puts = len(first.puts)
            while n_puts < MAX_BATCH:
                try:
                    nxt = self._queue.get_nowait()
                except queue.Empty:
                    break
                if nxt is None:
                    self._queue.put(None)  # finish this batch, then stop
                    break
                batch.append(nxt)
                n_puts += len(nxt.puts)
            self._commit(batch)

    def _commit(self, batch: list[_PutRequest]) -> None:
        """One transaction for the whole batch: look every id up at once, insert the new."""
        results: list[PutResult] = []
        accepted: list[StoredGroup] = []
        rows: list[tuple[Any, ...]] = []
        now = time.time()
        # the trainer only takes from the buffer meanwhile, so the room can only grow
        room = self.max_buffer_groups - len(self._buffer)
        room_bytes = self.max_buffer_bytes - self._buffer_bytes
        # a caller that gave up (its Submit was cancelled at its deadline) cancelled its
        # future; its rows are committed all the same and a resend hears DUPLICATE. The
        # others cannot be cancelled from here on, so setting their result cannot raise
        # (which killed this thread and stalled every Submit).
        waiting = [req.future.set_running_or_notify_cancel() for req in batch]
        try:
            with self._db_lock:
                self._db.execute("BEGIN IMMEDIATE")
                puts = [put for req in batch for put in req.puts]
                ids = [put.facts.id for put in puts]
                known: dict[str, PutResult] = {
                    gid: _recorded_outcome(state, refusal, reason)
                    for gid, state, refusal, reason in self._db.execute(
                        "SELECT id, state, refusal, reason FROM groups WHERE id IN "
                        f"({','.join('?' * len(ids))})",
                        ids,
                    )
                }
                for put in puts:
                    f = put.facts
                    if f.id in known:
                        results.append(known[f.id])
                        continue
                    if put.outcome == "accepted" and (
                        room <= 0 or len(put.payload) > room_bytes
                    ):
                        results.append(PutResult("busy", self._busy_reason(room <= 0)))
                        continue
                    buffered = put.outcome == "accepted"
                    refusal = "" if buffered else put.outcome
                    reason = "" if buffered else (put.reason or put.outcome)
                    rows.append((
                        f.id, f.task, f.n_trajectories, f.min_version,
                        "buffered" if buffered else "rejected", reason, refusal, now,
                        put.payload if buffered else None, ",".join(f.trajectory_ids),
                        ",".join(f.revisions), f.reward_sum,
                    ))
                    result = PutResult(put.outcome, put.reason)
                    results.append(result)
                    # the same id twice in one batch: the second hears what the first got
                    known[f.id] = result if not buffered else PutResult("duplicate", "")
                    if buffered:
                        room -= 1
                        room_bytes -= len(put.payload)
                        accepted.append(StoredGroup(f, put.payload, now))
                self._db.executemany(
                    "INSERT INTO groups (id, task, n_traj, min_version, state, reason, refusal, "
                    "received_at, payload, trajectory_ids, revisions, reward_sum) "
                    "VALUES (?,?,?,?,?,?,?,?,?,?,?,?)",
                    rows,
                )
                self._db.execute("COMMIT")
            self._tally.added([
                (row[0], row[1], row[4], row[6], row[2], row[11]) for row in rows
            ])
        except sqlite3.Error as exc:
            with self._db_lock:
                if self._db.in_transaction:
                    self._db.execute("ROLLBACK")
            for req, wants in zip(batch, waiting):
                if wants:
                    req.future.set_exception(exc)
            return
        if accepted:
            with self._buffer_cond:
                self._buffer.extend(accepted)
                self._buffer_bytes += sum(len(s.payload) for s in accepted)
                self._buffer_cond.notify_all()
        start = 0
        for req, wants in zip(batch, waiting):
            if wants:
                req.future.set_result(results[start : start + len(req.puts)])
            start += len(req.puts)

    def recorded(self, group_id: str) -> PutResult | None:
        """The outcome a group already stored would get again (None: never stored)."""
        with self._db_lock:
            row = self._db.execute(
                "SELECT state, refusal, reason FROM groups WHERE id=?", (group_id,)
            ).fetchone()
        return None if row is None else _recorded_outcome(*row)

    # --- the trainer's side ----------------------------------------------------------

    def take(
        self, n: int, timeout_s: float, tasks: Collection[str] | None = None,
        newest_first: bool = False,
    ) -> list[StoredGroup]:
        """Up to n buffered groups (of `tasks` only, when given: the batch builder's mixing
        ratios), oldest first, or with `newest_first` those made at the highest model
        version first (the latest arrived among equals); waits up to timeout_s for the
        first n."""
        deadline = time.monotonic() + timeout_s

        def matching() -> list[StoredGroup]:
            pool: Iterable[StoredGroup] = self._buffer
            if tasks is not None:
                pool = (s for s in pool if s.facts.task in tasks)
            if newest_first:  # the highest version first; among equals the latest arrival
                ranked = sorted(enumerate(pool), key=lambda e: (-e[1].facts.min_version, -e[0]))
                pool = (s for _, s in ranked)
            return list(itertools.islice(pool, n))

        with self._buffer_cond:
            found = matching()
            while len(found) < n and not self._closed:
                left = deadline - time.monotonic()
                if left <= 0:
                    break
                self._buffer_cond.wait(left)
                found = matching()
            if tasks is None and not newest_first:
                for _ in found:
                    self._buffer.popleft()
            else:
                chosen = {id(s) for s in found}
                self._buffer = deque(s for s in self._buffer if id(s) not in chosen)
            self._buffer_bytes -= sum(len(s.payload) for s in found)
        return found

    def take_older_than(self, min_version: int) -> list[StoredGroup]:
        """Every buffered group made before `min_version` (oldest first): too stale to train
        now, and only older as versions go on."""
        with self._buffer_cond:
            old = [s for s in self._buffer if s.facts.min_version < min_version]
            if old:
                self._buffer = deque(s for s in self._buffer if s.facts.min_version >= min_version)
                self._buffer_bytes -= sum(len(s.payload) for s in old)
        return old

    def give_back(self, groups: list[StoredGroup]) -> None:
        """Return groups that were taken but not trained (front of the queue, same order)."""
        with self._buffer_cond:
            self._buffer.extendleft(reversed(groups))
            self._buffer_bytes += sum(len(s.payload) for s in groups)
            self._buffer_cond.notify_all()

    def mark_trained(self, group_ids: list[str], step: int) -> None:
        with self._db_lock:
            self._db.execute("BEGIN IMMEDIATE")
            moving = self._rows_of(group_ids)
            self._db.executemany(
                "UPDATE groups SET state='trained', step=? WHERE id=?",
                [(step, gid) for gid in group_ids],
            )
            self._db.executemany(
                "INSERT INTO train_log (group_id, step, epoch) VALUES (?, ?, ?)",
                [(gid, step, self.epoch) for gid in group_ids],
            )
            self._db.execute("COMMIT")
            self._tally.moved(moving, "trained")

    def _rows_of(self, group_ids: list[str]) -> list[tuple[str, str, str, str, int]]:
        """(id, task, state, refusal, trajectories) of the stored ones of `group_ids`, read by
        primary key (the cost of the batch, not of the table)."""
        rows: list[tuple[str, str, str, str, int]] = []
        unique = list(dict.fromkeys(group_ids))
        for start in range(0, len(unique), MAX_BATCH):
            ids = unique[start : start + MAX_BATCH]
            rows += self._db.execute(
                f"SELECT id, task, state, refusal, n_traj FROM groups WHERE id IN "
                f"({','.join('?' * len(ids))})",
                ids,
            ).fetchall()
        return rows

    def forget_payloads(self, through_step: int) -> None:
        """Drop payloads of groups trained at or before a completed checkpoint's step.

        Until then a trained group keeps its payload: a crash before the next checkpoint
        loses those steps, and open() buffers such groups again. The trainer picks the
        checkpoint by `checkpoint.keep_trained_groups`: the newest (1), an older one so that
        `jetctl replay` can take the steps after it again, or none at all (all). A group's
        row and facts (trajectory ids, rewards) stay whatever happens to its payload.
        """
        with self._db_lock:
            # INDEXED BY: without statistics sqlite picks groups_state, and state='trained'
            # is nearly every row of an old run
            self._db.execute(
                "UPDATE groups INDEXED BY groups_unforgotten SET payload=NULL "
                "WHERE payload IS NOT NULL AND step <= ? AND state='trained'",
                (through_step,),
            )

    def mark_rejected(
        self, group_ids: list[str], reason: str, refusal: Refusal = "stale"
    ) -> None:
        """Refuse buffered groups after all (the trainer's batch-time staleness gate)."""
        if refusal not in REFUSALS:
            raise ValueError(f"refusal {refusal!r} is not one of {', '.join(REFUSALS)}")
        with self._db_lock:
            self._db.execute("BEGIN IMMEDIATE")
            moving = self._rows_of(group_ids)
            self._db.executemany(
                "UPDATE groups SET state='rejected', refusal=?, reason=?, payload=NULL WHERE id=?",
                [(refusal, reason, gid) for gid in group_ids],
            )
            self._db.execute("COMMIT")
            self._tally.moved(moving, "rejected", refusal)

    # --- figures ---------------------------------------------------------------------

    @property
    def buffer_depth(self) -> int:
        return len(self._buffer)

    @property
    def buffer_bytes(self) -> int:
        """Payload bytes of the buffered groups."""
        return self._buffer_bytes

    def _busy_reason(self, full_of_groups: bool) -> str:
        held = (
            f"{self.max_buffer_groups} untrained groups (limits.max_buffer_groups)"
            if full_of_groups else
            f"{self._buffer_bytes} bytes of untrained groups, and this one would pass "
            f"{self.max_buffer_bytes} (limits.max_buffer_bytes)"
        )
        return f"busy: the server holds {held}; not stored, send it again later"

    def counts(self) -> StoreCounts:
        """Trajectory and group counts by state, and of the rejected ones by refusal."""
        return self._tally.counts()

    def received_by_task(self) -> dict[str, int]:
        """Trajectories received of each task (any outcome)."""
        return self._tally.received_by_task()

    def reward_by_task(self, last_groups: int = REWARD_WINDOW) -> dict[str, float]:
        """Mean trajectory reward of each task's last `last_groups` accepted groups (those
        rejected after all at batch time left out)."""
        if not 1 <= last_groups <= REWARD_WINDOW:
            raise ValueError(f"last_groups ({last_groups}) must be in 1..{REWARD_WINDOW}")
        return self._tally.reward_by_task(last_groups)


def _recorded_outcome(state: str, refusal: str, reason: str) -> PutResult:
    if state == "rejected":
        return PutResult(cast(Refusal, refusal), reason)
    return PutResult("duplicate", "")
