"""A change journal of a sqlite file: the ledger's records, as the controller receives them.

A client node's spool and a server's store live on their own host's disk; the ledger is
built on the controller's host from what it received (docs/architecture.md section 6). So
each of those files gets a journal: sqlite triggers append one row to `ledger_journal` for
every change of the tables the ledger reads, in the same transaction as the change itself,
so a journal never misses a change nor records one that was rolled back.

    journal = Journal.install(spool_path, SPOOL_TABLES)
    records = journal.since(seq=0, limit=500)       # [Record(seq, table, op, key, data)]
    journal.id                                      # names this journal (a uuid)

A record is `put` (the row's ledger columns as JSON, replacing any earlier row of that key)
or `del`. The first install seeds the journal with a `put` for every row already there, so
the journal replays the whole table from seq 1. Nothing is ever pruned: a controller that
lost its copy asks again from where it stands (`jetctl.controller.received`).

Updates of columns the ledger does not read (a pending group's attempt count, a trained
group's payload being dropped) add nothing.
"""

from __future__ import annotations

import sqlite3
import uuid
from collections.abc import Mapping, Sequence
from contextlib import closing
from dataclasses import dataclass
from pathlib import Path

JOURNAL_TABLE = "ledger_journal"
META_TABLE = "ledger_journal_meta"


@dataclass(frozen=True)
class Tracked:
    """One table the ledger reads: its key column (or `rowid`) and the columns it needs."""

    key: str
    columns: tuple[str, ...]


# what jetctl.ledger reads of a client node's spool (jetctl.client.spool) ...
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
    table: str
    op: str  # put | del
    key: str
    data: str  # JSON object of the tracked columns ('' for del)


def _columns(db: sqlite3.Connection, table: str) -> list[str]:
    return [r[1] for r in db.execute(f"PRAGMA table_info({table})")]


def _json(columns: Sequence[str], row: str) -> str:
    args = ", ".join(f"'{c}', {row}.{c}" for c in columns)
    return f"json_object({args})"


class Journal:
    """The journal of one sqlite file (see the module docstring)."""

    def __init__(self, path: Path, journal_id: str) -> None:
        self.path = Path(path)
        self.id = journal_id

    @staticmethod
    def install(path: Path, tables: Mapping[str, Tracked]) -> Journal:
        """Create the journal and its triggers in `path` (once; later calls find them).
        The tables must exist; a tracked column a table lacks (an old file) is left out."""
        with closing(sqlite3.connect(str(path), timeout=30.0, isolation_level=None)) as db:
            db.execute("BEGIN IMMEDIATE")
            try:
                journal_id = _install(db, tables)
                db.execute("COMMIT")
            except BaseException:
                db.execute("ROLLBACK")
                raise
        return Journal(Path(path), journal_id)

    def since(self, seq: int, limit: int = 500) -> list[Record]:
        """Records after `seq`, oldest first, at most `limit`."""
        with closing(sqlite3.connect(str(self.path), timeout=30.0)) as db:
            rows = db.execute(
                f"SELECT seq, tbl, op, key, data FROM {JOURNAL_TABLE} WHERE seq > ? "
                "ORDER BY seq LIMIT ?",
                (seq, limit),
            ).fetchall()
        return [Record(int(s), t, o, str(k), d or "") for s, t, o, k, d in rows]

    def last_seq(self) -> int:
        with closing(sqlite3.connect(str(self.path), timeout=30.0)) as db:
            row = db.execute(f"SELECT COALESCE(MAX(seq), 0) FROM {JOURNAL_TABLE}").fetchone()
        return int(row[0])


def _install(db: sqlite3.Connection, tables: Mapping[str, Tracked]) -> str:
    existing = {r[0] for r in db.execute("SELECT name FROM sqlite_master WHERE type='table'")}
    fresh = JOURNAL_TABLE not in existing
    db.execute(
        f"CREATE TABLE IF NOT EXISTS {JOURNAL_TABLE} (seq INTEGER PRIMARY KEY AUTOINCREMENT, "
        "tbl TEXT NOT NULL, op TEXT NOT NULL, key TEXT NOT NULL, data TEXT)"
    )
    db.execute(f"CREATE TABLE IF NOT EXISTS {META_TABLE} (id TEXT NOT NULL)")
    row = db.execute(f"SELECT id FROM {META_TABLE}").fetchone()
    if row is None:
        row = (str(uuid.uuid4()),)
        db.execute(f"INSERT INTO {META_TABLE} (id) VALUES (?)", row)
    for table, spec in tables.items():
        have = set(_columns(db, table))
        cols = [c for c in spec.columns if c in have]
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
        if fresh:  # replay what the table held before the journal existed
            args = ", ".join(f"'{c}', {c}" for c in cols)
            keycol = "rowid" if spec.key == "rowid" else spec.key
            db.execute(
                f"INSERT INTO {JOURNAL_TABLE} (tbl, op, key, data) "
                f"SELECT '{table}', 'put', {keycol}, json_object({args}) FROM {table} "
                f"ORDER BY rowid"
            )
    return str(row[0])
