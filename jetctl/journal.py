"""A change journal of a sqlite file: the ledger's records, as the controller receives them.

A client node's spool and a server's store live on their own host's disk; the ledger is
built on the controller's host from what it received (docs/architecture.md section 6). So
each of those files gets a journal: sqlite triggers append one row to `ledger_journal` for
every change of the tables the ledger reads, in the same transaction as the change itself,
so a journal never misses a change nor records one that was rolled back.

    journal = Journal.install(spool_path, SPOOL_TABLES)
    records = journal.since(seq=0, limit=500)       # [Record(seq, table, op, key, data)]
    journal.prune(through=held)                     # the controller holds up to `held`
    journal.id                                      # names this journal (a uuid)

A record is `put` (the row's ledger columns as JSON, replacing any earlier row of that key),
`del`, or `reset` (forget every row of this journal: a snapshot follows). The first install
seeds the journal with a `put` for every row already there, so the journal replays the whole
table from seq 1.

Bounded: the node prunes what the controller holds. Each Sync reply carries the seq up to
which the controller's copy holds this journal (`jetctl.controller.received`, committed
before the reply), and the node's link calls `prune(through=that seq)`: the records at or
below it are deleted and the seq is kept as the journal's `pruned` mark (in batches of
`PRUNE_BATCH`, so the journal holds what the controller has not taken plus at most one
batch). A controller that lost its copy (received.sqlite deleted, or its last commits lost
with its host's OS) asks from a seq below the mark; `since` then appends a snapshot, a
`reset` and a `put` for every current row (what the first install seeds), in one
transaction, and answers from the reset; the controller's copy takes a reset at any seq
above what it holds, drops that journal's rows and rebuilds them from the puts. The journal
keeps its id and its seqs only grow (AUTOINCREMENT), so a record is never sent twice under
one seq with two meanings. A snapshot is made once: a later ask from below the mark answers
from the newest reset still in the journal (every reset is above the mark).

Updates of columns the ledger does not read (a pending group's attempt count, a trained
group's payload being dropped) add nothing.
"""

from __future__ import annotations

import sqlite3
import uuid
from collections.abc import Callable, Mapping, Sequence
from contextlib import closing
from dataclasses import dataclass
from pathlib import Path
from typing import TypeVar

JOURNAL_TABLE = "ledger_journal"
META_TABLE = "ledger_journal_meta"
RESET = "reset"  # the op of the record that starts a snapshot
# prune when this many records are held by the controller: one short transaction every so
# often rather than one each sync; the journal holds at most this many records it could drop
PRUNE_BATCH = 1_000

T = TypeVar("T")


@dataclass(frozen=True)
class Tracked:
    """One table the ledger reads: its key column (or `rowid`) and the columns it needs."""

    key: str
    columns: tuple[str, ...]


# what jetctl.run.ledger reads of a client node's spool (jetctl.client.spool) ...
SPOOL_TABLES: Mapping[str, Tracked] = {
    "inflight": Tracked("trajectory_id", ("group_id", "model")),
    "pending": Tracked("id", ("n_trajectories", "trajectory_ids", "model")),
    "outcomes": Tracked(
        "group_id", ("n_trajectories", "outcome", "reason", "trajectory_ids", "model")
    ),
    "dropped": Tracked("trajectory_id", ("reason", "model")),
    "outcome_totals": Tracked("key", ("model", "outcome", "groups", "trajectories")),
}
# ... and of a server's store (jetctl.server.store)
STORE_TABLES: Mapping[str, Tracked] = {
    "groups": Tracked("id", ("n_traj", "state", "refusal", "reason", "step", "trajectory_ids")),
    "epochs": Tracked("epoch", ("resumed_from",)),
    "train_log": Tracked("rowid", ("group_id", "step", "epoch")),
}


@dataclass(frozen=True)
class Record:
    seq: int
    table: str  # '' for reset
    op: str  # put | del | reset
    key: str
    data: str  # JSON object of the tracked columns ('' for del and reset)


def _columns(db: sqlite3.Connection, table: str) -> list[str]:
    return [r[1] for r in db.execute(f"PRAGMA table_info({table})")]


def _json(columns: Sequence[str], row: str) -> str:
    args = ", ".join(f"'{c}', {row}.{c}" for c in columns)
    return f"json_object({args})"


def _connect(path: Path) -> sqlite3.Connection:
    # isolation_level=None: autocommit; each write below is one explicit transaction
    return sqlite3.connect(str(path), timeout=30.0, isolation_level=None)


class Journal:
    """The journal of one sqlite file (see the module docstring)."""

    def __init__(self, path: Path, journal_id: str, tables: Mapping[str, Tracked]) -> None:
        self.path = Path(path)
        self.id = journal_id
        self.tables = tables  # what a snapshot puts

    @staticmethod
    def install(path: Path, tables: Mapping[str, Tracked]) -> Journal:
        """Create the journal and its triggers in `path` (once; later calls find them).
        The tables must exist; a tracked column a table lacks (an old file) is left out."""
        with closing(_connect(path)) as db:
            journal_id = _write(db, lambda: _install(db, tables))
        return Journal(Path(path), journal_id, tables)

    def since(self, seq: int, limit: int = 500) -> list[Record]:
        """Records after `seq`, oldest first, at most `limit`. When records after `seq` were
        pruned, the answer starts at a snapshot's `reset` (made now when none is left)."""
        with closing(_connect(self.path)) as db:
            if seq < _pruned(db):
                seq = _write(db, lambda: _snapshot(db, self.tables)) - 1
            rows = db.execute(
                f"SELECT seq, tbl, op, key, data FROM {JOURNAL_TABLE} WHERE seq > ? "
                "ORDER BY seq LIMIT ?",
                (seq, limit),
            ).fetchall()
        return [Record(int(s), t, o, str(k), d or "") for s, t, o, k, d in rows]

    def prune(self, through: int, batch: int = PRUNE_BATCH) -> int:
        """Delete the records at or below `through`, which the controller says it holds,
        once at least `batch` of them wait; returns how many went. Never beyond the last
        record written (a controller cannot hold more than was sent)."""
        with closing(_connect(self.path)) as db:
            through = min(through, _last_seq(db))
            if through - _pruned(db) < max(batch, 1):
                return 0
            return _write(db, lambda: _prune(db, through))

    def pruned(self) -> int:
        """The seq at or below which records were pruned (0: none)."""
        with closing(_connect(self.path)) as db:
            return _pruned(db)

    def last_seq(self) -> int:
        """The seq of the last record written (pruned or not; 0: none yet)."""
        with closing(_connect(self.path)) as db:
            return _last_seq(db)


def _write(db: sqlite3.Connection, body: Callable[[], T]) -> T:
    """`body` in one BEGIN IMMEDIATE ... COMMIT (ROLLBACK on error)."""
    db.execute("BEGIN IMMEDIATE")
    try:
        out = body()
        db.execute("COMMIT")
    except BaseException:
        db.execute("ROLLBACK")
        raise
    return out


def _pruned(db: sqlite3.Connection) -> int:
    row = db.execute(f"SELECT pruned FROM {META_TABLE}").fetchone()
    return int(row[0]) if row else 0


def _last_seq(db: sqlite3.Connection) -> int:
    # AUTOINCREMENT's high-water mark: the last seq ever given, also after pruning them all
    row = db.execute(
        "SELECT seq FROM sqlite_sequence WHERE name = ?", (JOURNAL_TABLE,)
    ).fetchone()
    return int(row[0]) if row else 0


def _prune(db: sqlite3.Connection, through: int) -> int:
    n = db.execute(f"DELETE FROM {JOURNAL_TABLE} WHERE seq <= ?", (through,)).rowcount
    db.execute(f"UPDATE {META_TABLE} SET pruned = MAX(pruned, ?)", (through,))
    return int(n)


def _snapshot(db: sqlite3.Connection, tables: Mapping[str, Tracked]) -> int:
    """The seq of the newest `reset` left in the journal; when there is none, a `reset` and
    a `put` for every current row are appended (in this transaction) and its seq returned."""
    row = db.execute(
        f"SELECT MAX(seq) FROM {JOURNAL_TABLE} WHERE op = '{RESET}'"
    ).fetchone()
    if row[0] is not None:
        return int(row[0])
    seq = db.execute(
        f"INSERT INTO {JOURNAL_TABLE} (tbl, op, key, data) VALUES ('', '{RESET}', '', NULL)"
    ).lastrowid
    _seed(db, tables)
    return int(seq or 0)


def _tracked_columns(db: sqlite3.Connection, table: str, spec: Tracked) -> list[str]:
    have = set(_columns(db, table))
    return [c for c in spec.columns if c in have]


def _seed(db: sqlite3.Connection, tables: Mapping[str, Tracked]) -> None:
    """A `put` for every row of every tracked table (what the journal replays from)."""
    for table, spec in tables.items():
        args = ", ".join(f"'{c}', {c}" for c in _tracked_columns(db, table, spec))
        keycol = "rowid" if spec.key == "rowid" else spec.key
        db.execute(
            f"INSERT INTO {JOURNAL_TABLE} (tbl, op, key, data) "
            f"SELECT '{table}', 'put', {keycol}, json_object({args}) FROM {table} "
            f"ORDER BY rowid"
        )


def _install(db: sqlite3.Connection, tables: Mapping[str, Tracked]) -> str:
    existing = {r[0] for r in db.execute("SELECT name FROM sqlite_master WHERE type='table'")}
    fresh = JOURNAL_TABLE not in existing
    db.execute(
        f"CREATE TABLE IF NOT EXISTS {JOURNAL_TABLE} (seq INTEGER PRIMARY KEY AUTOINCREMENT, "
        "tbl TEXT NOT NULL, op TEXT NOT NULL, key TEXT NOT NULL, data TEXT)"
    )
    db.execute(
        f"CREATE TABLE IF NOT EXISTS {META_TABLE} "
        "(id TEXT NOT NULL, pruned INTEGER NOT NULL DEFAULT 0)"
    )
    if "pruned" not in _columns(db, META_TABLE):  # a journal installed before pruning
        db.execute(f"ALTER TABLE {META_TABLE} ADD COLUMN pruned INTEGER NOT NULL DEFAULT 0")
    row = db.execute(f"SELECT id FROM {META_TABLE}").fetchone()
    if row is None:
        row = (str(uuid.uuid4()),)
        db.execute(f"INSERT INTO {META_TABLE} (id) VALUES (?)", row)
    for table, spec in tables.items():
        cols = _tracked_columns(db, table, spec)
        key = "NEW.rowid" if spec.key == "rowid" else f"NEW.{spec.key}"
        old_key = "OLD.rowid" if spec.key == "rowid" else f"OLD.{spec.key}"
        put = (
            f"INSERT INTO {JOURNAL_TABLE} (tbl, op, key, data) "
            f"VALUES ('{table}', 'put', {key}, {_json(cols, 'NEW')});"
        )
        db.execute(
            f"CREATE TRIGGER IF NOT EXISTS {JOURNAL_TABLE}_{table}_ins AFTER INSERT ON {table} "
            f"BEGIN {put} END"
        )
        db.execute(
            f"CREATE TRIGGER IF NOT EXISTS {JOURNAL_TABLE}_{table}_upd "
            f"AFTER UPDATE OF {', '.join(cols)} ON {table} BEGIN {put} END"
        )
        db.execute(
            f"CREATE TRIGGER IF NOT EXISTS {JOURNAL_TABLE}_{table}_del AFTER DELETE ON {table} "
            f"BEGIN INSERT INTO {JOURNAL_TABLE} (tbl, op, key, data) "
            f"VALUES ('{table}', 'del', {old_key}, NULL); END"
        )
    if fresh:  # replay what the tables held before the journal existed
        _seed(db, tables)
    return str(row[0])
