"""The client node's durable spool: trajectory groups wait here until the server acks them.

One sqlite file per node (`<run_dir>/spool/<node>.sqlite`, WAL, `synchronous=FULL`, so a
`put` that returned survives `kill -9` and power loss). Six tables:

* `inflight` - one row per trajectory id of a rollout in progress (written before the
  rollout starts). `put` and `drop` remove the rows in the same transaction (`drop_group`
  too: a group whose task failed), so only a node killed mid-rollout leaves them behind,
  and its successor records them as `dropped(lost)` (`recover_lost`): a crash loses
  rollouts, never half a group.
* `pending`  - groups not yet acked: id, serialized `TrajectoryGroup` protobuf, trajectory
  count and ids, created_at, attempts, next_attempt_at. A group leaves only through `ack`.
* `outcomes` - one row per recently acked group: accepted | duplicate | stale | invalid |
  revision, with the server's reason and the group's trajectory ids. Only the newest
  `keep_outcomes` rows stay: older ones are folded (`compact`, run by `ack`) into
* `outcome_totals` - groups and trajectories per (model, outcome) of the acked groups whose
  rows were folded, so the spool's size does not grow with the run's age while every total
  (`counts`, the ledger's) stays what it was. A folded group's `outcome` reads None.
* `dropped`  - one row per trajectory the node gave up on before sending (timeout | failed |
  dead-letter | lost), with the error text and traceback.
* `waste`    - the node's waste tally (jetctl/costs.py `NodeWaste`): key -> summed value. A
  refused `ack`, a `dead_letter` and `recover_lost` add theirs in their own transaction.

The trajectory ids are what `jetctl.run.ledger` balances against the servers' stores (a folded
ack's ids are the server's to name: the ledger counts them from `outcome_totals`). Every
row also names the model its trajectories are for (`model`; '' in spools written before
teams, whose node served one model), so the ledger balances per model: a team task's node
spools one group per role, each bound for its own model's server.

The spool never evicts: back-pressure (stop starting rollouts above a byte watermark) is the
node's job, and `committed_bytes` is what it reads where it adds a group: `bytes` (a running
count of the pending payload bytes, read from the file once at open and kept by each write
after it commits: O(1), however many groups wait) plus the groups still in progress (a
running count of the groups with rows in `inflight`, kept the same way) at the mean size of
the groups spooled so far, so the groups in flight cannot carry the spool past the watermark
when they land (before the first group lands their size is unknown: 0).
Used from one thread of one process; sqlite's own locking makes a second opener (a restarted
node) safe (another opener's writes are not in this one's running counts until it reopens).

The ledger journal (`jetctl.journal`) a node installs in this file is pruned as the
controller takes its records (the node's link prunes up to what each Sync reply says the
controller holds), so it holds what the controller has not taken plus at most one batch. A
fold is journaled as a `del` of each folded row and a `put` of its total, so the
controller's copy (or a snapshot, after it lost its copy) holds the totals the ledger reads.

    spool = Spool(path)
    spool.put(group_id, payload, n_trajectories)
    for item in spool.due(limit=8, now=time.time()): ...
    spool.ack(item.id, "accepted", "")   # or spool.defer(item.id, delay_s)
"""

from __future__ import annotations

import sqlite3
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

Outcome = Literal["accepted", "duplicate", "stale", "invalid", "revision"]
DropReason = Literal["timeout", "failed", "dead-letter", "lost"]
OUTCOMES: tuple[str, ...] = ("accepted", "duplicate", "stale", "invalid", "revision")
KEEP_OUTCOMES = 10_000  # acked groups' rows kept as rows (for `outcome`, a trace); older: totals

_SCHEMA = """
CREATE TABLE IF NOT EXISTS pending (
    id TEXT PRIMARY KEY,
    payload BLOB NOT NULL,
    n_trajectories INTEGER NOT NULL,
    created_at REAL NOT NULL,
    attempts INTEGER NOT NULL DEFAULT 0,
    next_attempt_at REAL NOT NULL
);
CREATE INDEX IF NOT EXISTS pending_due ON pending (next_attempt_at);
CREATE TABLE IF NOT EXISTS outcomes (
    group_id TEXT PRIMARY KEY,
    n_trajectories INTEGER NOT NULL,
    outcome TEXT NOT NULL,
    reason TEXT NOT NULL,
    time REAL NOT NULL
);
CREATE TABLE IF NOT EXISTS outcome_totals (
    key TEXT PRIMARY KEY,  -- outcome ':' model (the journal keys rows by one column)
    model TEXT NOT NULL,
    outcome TEXT NOT NULL,
    groups INTEGER NOT NULL,
    trajectories INTEGER NOT NULL
);
CREATE TABLE IF NOT EXISTS dropped (
    trajectory_id TEXT PRIMARY KEY,
    reason TEXT NOT NULL,
    error TEXT NOT NULL,
    time REAL NOT NULL
);
CREATE TABLE IF NOT EXISTS inflight (
    trajectory_id TEXT PRIMARY KEY,
    group_id TEXT NOT NULL,
    started_at REAL NOT NULL
);
CREATE INDEX IF NOT EXISTS inflight_group ON inflight (group_id);
CREATE TABLE IF NOT EXISTS waste (
    key TEXT PRIMARY KEY,
    value REAL NOT NULL
);
"""
# columns added after the first release; spools written before them get them on open
_ADDED_COLUMNS = (
    ("pending", "trajectory_ids", "TEXT NOT NULL DEFAULT ''"),
    ("outcomes", "trajectory_ids", "TEXT NOT NULL DEFAULT ''"),
    ("inflight", "model", "TEXT NOT NULL DEFAULT ''"),
    ("pending", "model", "TEXT NOT NULL DEFAULT ''"),
    ("outcomes", "model", "TEXT NOT NULL DEFAULT ''"),
    ("dropped", "model", "TEXT NOT NULL DEFAULT ''"),
)


@dataclass(frozen=True)
class PendingGroup:
    """A group that is due for (re)sending."""

    id: str
    payload: bytes
    n_trajectories: int
    attempts: int
    created_at: float


@dataclass(frozen=True)
class SpooledGroup:
    """One group to store with `put_all`: its serialized protobuf and its trajectory ids."""

    id: str
    payload: bytes
    trajectory_ids: list[str]
    model: str = ""


@dataclass(frozen=True)
class SpoolCounts:
    """Totals for the status file and metrics."""

    pending_groups: int
    pending_bytes: int
    outcomes: dict[str, int]  # outcome -> groups (rows and folded totals)
    dropped: dict[str, int]  # reason -> trajectories


@dataclass(frozen=True)
class OutcomeTotal:
    """Acked groups folded out of `outcomes`: how many, of one model, with one outcome."""

    model: str
    outcome: str
    groups: int
    trajectories: int


class Spool:
    """Durable pending groups, acked outcomes and dropped trajectories (see module docstring)."""

    def __init__(self, path: Path | str, keep_outcomes: int = KEEP_OUTCOMES) -> None:
        if keep_outcomes < 0:
            raise ValueError(f"keep_outcomes ({keep_outcomes}) must be at least 0")
        self.path = Path(path)
        self.keep_outcomes = keep_outcomes
        self.path.parent.mkdir(parents=True, exist_ok=True)
        # isolation_level=None: autocommit; each write below is one explicit transaction.
        self._db = sqlite3.connect(str(self.path), isolation_level=None, timeout=30.0)
        self._db.execute("PRAGMA journal_mode=WAL")
        self._db.execute("PRAGMA synchronous=FULL")
        self._db.executescript(_SCHEMA)
        for table, column, decl in _ADDED_COLUMNS:
            have = {r[1] for r in self._db.execute(f"PRAGMA table_info({table})")}
            if column not in have:
                self._db.execute(f"ALTER TABLE {table} ADD COLUMN {column} {decl}")
        n, size = self._db.execute(
            "SELECT COUNT(*), COALESCE(SUM(LENGTH(payload)), 0) FROM pending"
        ).fetchone()
        self._bytes = int(size)  # the pending payload bytes, kept by each write from here on
        # groups spooled and their bytes (the mean size of a group in flight)
        self._seen_groups, self._seen_bytes = int(n), int(size)
        self._n_outcomes = int(self._db.execute("SELECT COUNT(*) FROM outcomes").fetchone()[0])
        # groups with rows in `inflight`, kept by each write that adds or removes them
        self._inflight_groups = int(
            self._db.execute("SELECT COUNT(DISTINCT group_id) FROM inflight").fetchone()[0]
        )

    def close(self) -> None:
        self._db.close()

    # ------------------------------------------------------------------ writes

    def start(
        self, group_id: str, trajectory_ids: list[str], now: float | None = None, model: str = ""
    ) -> None:
        """Record the ids of rollouts about to start (one transaction for the group)."""
        t = time.time() if now is None else now
        with self._tx():
            had = self._in_flight(group_id)
            self._db.executemany(
                "INSERT OR IGNORE INTO inflight (trajectory_id, group_id, started_at, model)"
                " VALUES (?, ?, ?, ?)",
                [(tid, group_id, t, model) for tid in trajectory_ids],
            )
            started = not had and self._in_flight(group_id)
        self._inflight_groups += started

    def label_unlabelled(self, model: str) -> int:
        """Rows written before spools named their model ('') belong to `model`, the model of
        the node that wrote them; returns how many pending groups that concerned."""
        with self._tx():
            n = self._db.execute("UPDATE pending SET model = ? WHERE model = ''", (model,)).rowcount
            for table in ("inflight", "outcomes", "dropped"):
                self._db.execute(f"UPDATE {table} SET model = ? WHERE model = ''", (model,))
            self._db.execute(  # totals folded before the label: merged into the model's
                "INSERT INTO outcome_totals (key, model, outcome, groups, trajectories)"
                " SELECT outcome || ':' || ?, ?, outcome, groups, trajectories"
                " FROM outcome_totals WHERE model = '' AND 1"
                " ON CONFLICT(key) DO UPDATE SET groups = groups + excluded.groups,"
                " trajectories = trajectories + excluded.trajectories",
                (model, model),
            )
            self._db.execute("DELETE FROM outcome_totals WHERE model = ''")
        return int(n)

    def recover_lost(
        self,
        error: str,
        now: float | None = None,
        waste: Callable[[int], Mapping[str, float]] | None = None,
    ) -> int:
        """Rollouts an earlier process of this node left in progress become `dropped(lost)`.
        Call once at start, before any rollout; returns how many. `waste(n)`: their waste
        tally, added in the same transaction."""
        t = time.time() if now is None else now
        with self._tx():
            n = self._db.execute(
                "INSERT OR IGNORE INTO dropped (trajectory_id, reason, error, time, model)"
                " SELECT trajectory_id, 'lost', ?, ?, model FROM inflight",
                (error, t),
            ).rowcount
            self._db.execute("DELETE FROM inflight")
            if n > 0 and waste is not None:
                self._add_waste(waste(int(n)))
        self._inflight_groups = 0
        return int(n)

    def drop_group(
        self, group_id: str, reason: DropReason, error: str, now: float | None = None
    ) -> int:
        """The group's trajectories still in progress become `dropped(reason)` with `error`
        (its task failed before spooling it), in one transaction; returns how many."""
        t = time.time() if now is None else now
        with self._tx():
            n = self._db.execute(
                "INSERT OR IGNORE INTO dropped (trajectory_id, reason, error, time, model)"
                " SELECT trajectory_id, ?, ?, ?, model FROM inflight WHERE group_id = ?",
                (reason, error, t, group_id),
            ).rowcount
            ended = self._leave_inflight(group_id)
        self._inflight_groups -= ended
        return int(n)

    def put(
        self,
        group_id: str,
        payload: bytes,
        n_trajectories: int,
        now: float | None = None,
        trajectory_ids: list[str] | None = None,
        model: str = "",
    ) -> None:
        """Store a group durably (committed before return). Re-putting an id is a no-op.
        The group's rollouts leave `inflight` in the same transaction."""
        t = time.time() if now is None else now
        ids = ",".join(trajectory_ids or [])
        with self._tx():
            added = self._insert_pending(group_id, payload, n_trajectories, t, ids, model)
            landed = self._leave_inflight(group_id)
        self._added(added)
        self._inflight_groups -= landed

    def put_all(self, groups: list[SpooledGroup], now: float | None = None) -> None:
        """`put` for several groups in one transaction: a team's groups of one rollout batch
        (one per role) are spooled together or not at all."""
        t = time.time() if now is None else now
        added: list[int | None] = []
        landed = 0
        with self._tx():
            for g in groups:
                added.append(self._insert_pending(
                    g.id, g.payload, len(g.trajectory_ids), t, ",".join(g.trajectory_ids), g.model
                ))
                landed += self._leave_inflight(g.id)
        self._added(*added)
        self._inflight_groups -= landed

    def _added(self, *sizes: int | None) -> None:
        """Groups a committed write added (None: the id was pending already)."""
        for size in sizes:
            if size is not None:
                self._bytes += size
                self._seen_groups += 1
                self._seen_bytes += size

    def _insert_pending(
        self, group_id: str, payload: bytes, n: int, t: float, ids: str, model: str
    ) -> int | None:
        """Insert a pending group (an id already pending is left as it is); returns the
        payload bytes it added (None when it added none)."""
        inserted = self._db.execute(
            "INSERT OR IGNORE INTO pending (id, payload, n_trajectories, created_at, attempts,"
            " next_attempt_at, trajectory_ids, model) VALUES (?, ?, ?, ?, 0, ?, ?, ?)",
            (group_id, payload, n, t, t, ids, model),
        ).rowcount
        return len(payload) if inserted == 1 else None

    def _in_flight(self, group_id: str) -> bool:
        """The group has rows in `inflight` (an index lookup, in the caller's transaction)."""
        return self._db.execute(
            "SELECT 1 FROM inflight WHERE group_id = ? LIMIT 1", (group_id,)
        ).fetchone() is not None

    def _leave_inflight(self, group_id: str) -> int:
        """Delete the group's `inflight` rows (in the caller's transaction); returns 1 when it
        had any (the group is no longer in progress), else 0."""
        n = self._db.execute("DELETE FROM inflight WHERE group_id = ?", (group_id,)).rowcount
        return int(n > 0)

    def ack(
        self,
        group_id: str,
        outcome: Outcome,
        reason: str = "",
        now: float | None = None,
        waste: Mapping[str, float] | None = None,
    ) -> bool:
        """The server answered for this group: record the outcome and remove it from pending;
        `waste` (a group refused for good: its trajectories' waste tally) is added in the same
        transaction. False when the group was no longer pending (nothing recorded)."""
        if outcome not in OUTCOMES:
            raise ValueError(f"outcome {outcome!r} is not one of {', '.join(OUTCOMES)}")
        t = time.time() if now is None else now
        with self._tx():
            row = self._db.execute(
                "SELECT n_trajectories, trajectory_ids, model, LENGTH(payload) FROM pending "
                "WHERE id = ?",
                (group_id,),
            ).fetchone()
            if row is None:
                return False  # already acked (a retried Submit answered twice)
            new = self._db.execute(
                "SELECT 1 FROM outcomes WHERE group_id = ?", (group_id,)
            ).fetchone() is None
            self._db.execute(
                "INSERT OR REPLACE INTO outcomes (group_id, n_trajectories, outcome, reason, time,"
                " trajectory_ids, model) VALUES (?, ?, ?, ?, ?, ?, ?)",
                (group_id, row[0], outcome, reason, t, row[1], row[2]),
            )
            self._db.execute("DELETE FROM pending WHERE id = ?", (group_id,))
            if waste:
                self._add_waste(waste)
        self._bytes -= int(row[3])
        self._n_outcomes += new
        # fold in batches (a tenth of what is kept): one short transaction every so often
        if self._n_outcomes > self.keep_outcomes + self.keep_outcomes // 10:
            self.compact()
        return True

    def compact(self, keep: int | None = None) -> int:
        """Fold all but the newest `keep` (default `keep_outcomes`) acked groups' rows into
        `outcome_totals`, in one transaction; returns how many rows were folded. Totals
        (`counts`, the ledger's) are the same before and after."""
        keep = self.keep_outcomes if keep is None else keep
        excess = self._n_outcomes - keep
        if excess <= 0:
            return 0
        with self._tx():
            # rowid order is ack order: INSERT OR REPLACE gives a re-acked row a new rowid
            cut = self._db.execute(
                "SELECT rowid FROM outcomes ORDER BY rowid LIMIT 1 OFFSET ?", (excess - 1,)
            ).fetchone()[0]
            # `WHERE` before `ON CONFLICT`: sqlite's upsert-after-SELECT parsing rule
            self._db.execute(
                "INSERT INTO outcome_totals (key, model, outcome, groups, trajectories)"
                " SELECT outcome || ':' || model, model, outcome, COUNT(*), SUM(n_trajectories)"
                " FROM outcomes WHERE rowid <= ? GROUP BY model, outcome"
                " ON CONFLICT(key) DO UPDATE SET groups = groups + excluded.groups,"
                " trajectories = trajectories + excluded.trajectories",
                (cut,),
            )
            n = self._db.execute("DELETE FROM outcomes WHERE rowid <= ?", (cut,)).rowcount
        self._n_outcomes -= n
        return int(n)

    def defer(self, group_id: str, delay_s: float, now: float | None = None) -> None:
        """A send failed: count the attempt and hold the group back for `delay_s`."""
        t = time.time() if now is None else now
        with self._tx():
            self._db.execute(
                "UPDATE pending SET attempts = attempts + 1, next_attempt_at = ? WHERE id = ?",
                (t + delay_s, group_id),
            )

    def retry_now(
        self, limit: int | None = None, now: float | None = None, model: str | None = None
    ) -> int:
        """Make deferred groups due now (the oldest `limit` of them, or all; of `model` only,
        when given): the server is reachable again, or a probe should go out. Attempts are
        kept. Returns how many."""
        t = time.time() if now is None else now
        of_model, args = _of_model(model)
        with self._tx():
            n = self._db.execute(
                "UPDATE pending SET next_attempt_at = ? WHERE id IN (SELECT id FROM pending"
                f" WHERE next_attempt_at > ?{of_model} ORDER BY created_at LIMIT ?)",
                (t, t, *args, -1 if limit is None else limit),
            ).rowcount
        return int(n)

    def drop(
        self,
        trajectory_id: str,
        reason: DropReason,
        error: str,
        now: float | None = None,
        model: str = "",
    ) -> None:
        """Record a trajectory the node will never send (timeout, failed, dead-letter)."""
        t = time.time() if now is None else now
        with self._tx():
            self._db.execute(
                "INSERT OR REPLACE INTO dropped (trajectory_id, reason, error, time, model)"
                " VALUES (?, ?, ?, ?, ?)",
                (trajectory_id, reason, error, t, model),
            )
            row = self._db.execute(
                "SELECT group_id FROM inflight WHERE trajectory_id = ?", (trajectory_id,)
            ).fetchone()
            self._db.execute("DELETE FROM inflight WHERE trajectory_id = ?", (trajectory_id,))
            ended = row is not None and not self._in_flight(str(row[0]))
        self._inflight_groups -= ended

    def dead_letter(
        self,
        group_id: str,
        trajectory_ids: list[str],
        error: str,
        waste: Mapping[str, float] | None = None,
    ) -> bool:
        """Give up on a pending group that can never be sent (e.g. larger than the server's
        message cap): its trajectories become `dropped(dead-letter)` and `waste` is added to
        the tally, in one transaction. False when the group was no longer pending."""
        t = time.time()
        with self._tx():
            row = self._db.execute(
                "SELECT model, LENGTH(payload) FROM pending WHERE id = ?", (group_id,)
            ).fetchone()
            if row is None:
                return False
            model = row[0]
            for tid in trajectory_ids:
                self._db.execute(
                    "INSERT OR REPLACE INTO dropped (trajectory_id, reason, error, time, model)"
                    " VALUES (?, 'dead-letter', ?, ?, ?)",
                    (tid, error, t, model),
                )
            self._db.execute("DELETE FROM pending WHERE id = ?", (group_id,))
            if waste:
                self._add_waste(waste)
        self._bytes -= int(row[1])
        return True

    def add_waste(self, tally: Mapping[str, float]) -> None:
        """Add to the node's waste tally (jetctl/costs.py `NodeWaste`), in one transaction."""
        with self._tx():
            self._add_waste(tally)

    def _add_waste(self, tally: Mapping[str, float]) -> None:
        """`add_waste` in the caller's transaction."""
        self._db.executemany(
            "INSERT INTO waste (key, value) VALUES (?, ?)"
            " ON CONFLICT(key) DO UPDATE SET value = value + excluded.value",
            [(k, float(v)) for k, v in tally.items()],
        )

    # ------------------------------------------------------------------ reads

    def waste(self) -> dict[str, float]:
        """The node's waste tally, key -> value (empty for a new spool)."""
        return {str(k): float(v) for k, v in self._db.execute(
            "SELECT key, value FROM waste ORDER BY key")}

    def due(
        self, limit: int, now: float | None = None, model: str | None = None
    ) -> list[PendingGroup]:
        """Up to `limit` pending groups whose next attempt is due, oldest first (of `model`
        only, when given: each of a team's models has its own sender)."""
        t = time.time() if now is None else now
        of_model, args = _of_model(model)
        rows = self._db.execute(
            "SELECT id, payload, n_trajectories, attempts, created_at FROM pending"
            f" WHERE next_attempt_at <= ?{of_model} ORDER BY next_attempt_at, created_at LIMIT ?",
            (t, *args, limit),
        ).fetchall()
        return [PendingGroup(r[0], bytes(r[1]), r[2], r[3], r[4]) for r in rows]

    def next_due_at(self, model: str | None = None) -> float | None:
        """When the earliest pending group becomes due (None when nothing is pending)."""
        of_model, args = _of_model(model)
        row = self._db.execute(
            f"SELECT MIN(next_attempt_at) FROM pending WHERE 1{of_model}", args
        ).fetchone()
        return None if row[0] is None else float(row[0])

    def inflight(self) -> int:
        """Rollouts in progress (their ids are recorded, their group is not spooled yet)."""
        return int(self._db.execute("SELECT COUNT(*) FROM inflight").fetchone()[0])

    def depth(self, model: str | None = None) -> int:
        """Pending groups (of `model` only, when given)."""
        of_model, args = _of_model(model)
        return int(
            self._db.execute(f"SELECT COUNT(*) FROM pending WHERE 1{of_model}", args).fetchone()[0]
        )

    def bytes(self) -> int:
        """Payload bytes of pending groups (a running count: O(1))."""
        return self._bytes

    def committed_bytes(self) -> int:
        """`bytes` plus what the groups in progress will add when they land, at the mean
        size of the groups spooled so far: the back-pressure figure, checked where a group
        is added (so the groups in flight cannot overshoot the watermark). O(1): both are
        running counts (the groups in progress: those with rows in `inflight`)."""
        if self._seen_groups == 0:
            return self._bytes
        return self._bytes + self._inflight_groups * self._seen_bytes // self._seen_groups

    def inflight_groups(self) -> int:
        """Groups with rollouts in progress (a running count: O(1))."""
        return self._inflight_groups

    def oldest_age_s(self, now: float | None = None) -> float:
        """Age of the oldest pending group in seconds (0 when empty)."""
        t = time.time() if now is None else now
        row = self._db.execute("SELECT MIN(created_at) FROM pending").fetchone()
        return 0.0 if row[0] is None else max(0.0, t - float(row[0]))

    def counts(self) -> SpoolCounts:
        outcomes = dict.fromkeys(OUTCOMES, 0)
        for outcome, n in self._db.execute(
            "SELECT outcome, COUNT(*) FROM outcomes GROUP BY outcome"
        ):
            outcomes[outcome] = int(n)
        for total in self.outcome_totals():
            outcomes[total.outcome] += total.groups
        dropped = {
            r: int(n)
            for r, n in self._db.execute("SELECT reason, COUNT(*) FROM dropped GROUP BY reason")
        }
        return SpoolCounts(self.depth(), self.bytes(), outcomes, dropped)

    def outcome_totals(self) -> list[OutcomeTotal]:
        """The acked groups folded out of `outcomes`, per (model, outcome)."""
        return [
            OutcomeTotal(str(m), str(o), int(g), int(n))
            for m, o, g, n in self._db.execute(
                "SELECT model, outcome, groups, trajectories FROM outcome_totals"
                " ORDER BY model, outcome"
            )
        ]

    def outcome(self, group_id: str) -> tuple[str, str] | None:
        """(outcome, reason) of an acked group, None if not acked or its row was folded
        into `outcome_totals` (see `compact`)."""
        row = self._db.execute(
            "SELECT outcome, reason FROM outcomes WHERE group_id = ?", (group_id,)
        ).fetchone()
        return None if row is None else (row[0], row[1])

    def dropped_rows(self) -> list[tuple[str, str, str]]:
        """(trajectory_id, reason, error) of every dropped trajectory."""
        return [
            (r[0], r[1], r[2])
            for r in self._db.execute("SELECT trajectory_id, reason, error FROM dropped")
        ]

    # ------------------------------------------------------------------ helpers

    def _tx(self) -> _Transaction:
        return _Transaction(self._db)


def _of_model(model: str | None) -> tuple[str, tuple[str, ...]]:
    """A WHERE clause tail (and its argument) keeping the rows of `model`; None keeps all."""
    return ("", ()) if model is None else (" AND model = ?", (model,))


class _Transaction:
    """BEGIN IMMEDIATE ... COMMIT (ROLLBACK on error): one durable write."""

    def __init__(self, db: sqlite3.Connection) -> None:
        self._db = db

    def __enter__(self) -> None:
        self._db.execute("BEGIN IMMEDIATE")

    def __exit__(self, exc_type: object, exc: object, tb: object) -> None:
        self._db.execute("ROLLBACK" if exc_type is not None else "COMMIT")
