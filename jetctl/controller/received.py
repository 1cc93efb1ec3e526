"""What the controller received of each node's ledger journal (jetctl.journal), kept on its disk.

Every node syncs with the controller (`Control.Sync`, about once a second) and sends the
records of its journal after the last one the controller holds; `apply` stores them and
returns how far this journal is now held, which the node sends from next time and prunes
its journal up to (committed here before the reply). Records must arrive in order and
without a gap: a batch that does not start right after what is held is ignored and the node
is told where to resume (after a controller restart, a lost reply, a second sender of the
same journal). The one exception is a batch that starts with a `reset` above what is held:
the node pruned what this copy lacks and sends a snapshot instead, so this journal's rows
are dropped and rebuilt from the snapshot's puts (jetctl.journal).

    received = Received(paths.received)
    held = received.apply(name="digits-0", kind="client", journal="<uuid>", records, final)
    rows = received.rows("client")      # {journal: (name, final, {table: {key: data}})}

`jetctl.run.ledger.build_ledger` reads this file: the ledger is built from what the controller
received, so it balances across hosts that share no disk.
"""

from __future__ import annotations

import json
import sqlite3
import threading
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from jetctl.journal import RESET, Record

_SCHEMA = """
CREATE TABLE IF NOT EXISTS journals (
    journal TEXT PRIMARY KEY,
    name TEXT NOT NULL,      -- node name (client) or model (server)
    kind TEXT NOT NULL,      -- client | server
    seq INTEGER NOT NULL,    -- records held up to here
    final INTEGER NOT NULL DEFAULT 0  -- the node said it sent everything and exited
);
CREATE TABLE IF NOT EXISTS rows (
    journal TEXT NOT NULL,
    tbl TEXT NOT NULL,
    key TEXT NOT NULL,
    data TEXT NOT NULL,
    PRIMARY KEY (journal, tbl, key)
);
"""


@dataclass(frozen=True)
class JournalRows:
    """One journal's current rows as the controller holds them."""

    name: str
    final: bool
    tables: dict[str, dict[str, dict[str, Any]]]  # table -> key -> columns


class Received:
    """The controller's copy of every node's journal (one sqlite file, WAL)."""

    def __init__(self, path: Path) -> None:
        self.path = Path(path)
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self._lock = threading.Lock()
        self._db = sqlite3.connect(
            str(self.path), check_same_thread=False, isolation_level=None, timeout=30.0
        )
        self._db.execute("PRAGMA journal_mode=WAL")
        # NORMAL: a commit survives the controller's crash, not the OS's; then a node resends
        # from the lower seq this file holds, or a snapshot when it pruned past it
        self._db.execute("PRAGMA synchronous=NORMAL")
        self._db.executescript(_SCHEMA)

    def close(self) -> None:
        with self._lock:
            self._db.close()

    def held(self, journal: str) -> int:
        with self._lock:
            row = self._db.execute(
                "SELECT seq FROM journals WHERE journal = ?", (journal,)
            ).fetchone()
        return int(row[0]) if row else 0

    def apply(
        self, *, name: str, kind: str, journal: str, records: Sequence[Record],
        final: bool = False,
    ) -> int:
        """Store `records` of `journal` if they continue what is held; returns the seq held."""
        with self._lock:
            db = self._db
            db.execute("BEGIN IMMEDIATE")
            try:
                row = db.execute(
                    "SELECT seq FROM journals WHERE journal = ?", (journal,)
                ).fetchone()
                held = int(row[0]) if row else 0
                if row is None:
                    db.execute(
                        "INSERT INTO journals (journal, name, kind, seq) VALUES (?, ?, ?, 0)",
                        (journal, name, kind),
                    )
                complete = not records or records[0].seq == held + 1 or (
                    records[0].op == RESET and records[0].seq > held
                )
                if records and complete:
                    for r in records:
                        if r.op == RESET:  # a snapshot's puts follow: the rows start over
                            db.execute("DELETE FROM rows WHERE journal = ?", (journal,))
                        elif r.op == "del":
                            db.execute(
                                "DELETE FROM rows WHERE journal = ? AND tbl = ? AND key = ?",
                                (journal, r.table, r.key),
                            )
                        else:
                            db.execute(
                                "INSERT OR REPLACE INTO rows (journal, tbl, key, data) "
                                "VALUES (?, ?, ?, ?)",
                                (journal, r.table, r.key, r.data),
                            )
                    held = records[-1].seq
                db.execute(
                    "UPDATE journals SET seq = ?, name = ?, final = ? WHERE journal = ?",
                    (held, name, int(final and complete), journal),
                )
                db.execute("COMMIT")
            except BaseException:
                db.execute("ROLLBACK")
                raise
        return held

    def journals(self, kind: str) -> dict[str, JournalRows]:
        """journal -> its rows, for every journal of `kind` (client | server)."""
        with self._lock:
            heads = self._db.execute(
                "SELECT journal, name, final FROM journals WHERE kind = ?", (kind,)
            ).fetchall()
            out: dict[str, JournalRows] = {
                j: JournalRows(str(n), bool(f), {}) for j, n, f in heads
            }
            for journal, tbl, key, data in self._db.execute(
                "SELECT r.journal, r.tbl, r.key, r.data FROM rows r "
                "JOIN journals j ON j.journal = r.journal WHERE j.kind = ?",
                (kind,),
            ):
                out[journal].tables.setdefault(tbl, {})[key] = json.loads(data)
        return out
