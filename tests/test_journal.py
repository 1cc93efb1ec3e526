"""A spool's journal records every change the ledger reads, in the change's own transaction,
and a controller's copy takes the records only in order."""

from __future__ import annotations

import sqlite3
from pathlib import Path

import pytest

from jetctl.client.spool import Spool
from jetctl.controller.received import Received
from jetctl.journal import SPOOL_TABLES, Journal

pytestmark = pytest.mark.unit


def test_the_journal_records_puts_and_deletes_and_skips_other_columns(tmp_path: Path) -> None:
    spool = Spool(tmp_path / "n.sqlite")
    journal = Journal.install(spool.path, SPOOL_TABLES)
    spool.start("g1", ["a", "b"])
    spool.put("g1", b"payload", 2, trajectory_ids=["a", "b"])
    spool.defer("g1", 5.0)  # attempts and next_attempt_at: nothing the ledger reads
    spool.ack("g1", "accepted", "")
    ops = [(r.table, r.op, r.key) for r in journal.since(0)]
    assert ops == [
        ("inflight", "put", "a"), ("inflight", "put", "b"),
        ("pending", "put", "g1"), ("inflight", "del", "a"), ("inflight", "del", "b"),
        ("outcomes", "put", "g1"), ("pending", "del", "g1"),
    ]
    assert '"outcome":"accepted"' in journal.since(5)[0].data
    assert Journal.install(spool.path, SPOOL_TABLES).id == journal.id, "installed once"


def test_a_late_install_replays_what_the_tables_held(tmp_path: Path) -> None:
    spool = Spool(tmp_path / "n.sqlite")
    spool.start("g1", ["a"])
    spool.drop("a", "timeout", "slow")
    journal = Journal.install(spool.path, SPOOL_TABLES)
    assert [(r.table, r.key) for r in journal.since(0)] == [("dropped", "a")]


def test_a_rolled_back_change_leaves_no_record(tmp_path: Path) -> None:
    spool = Spool(tmp_path / "n.sqlite")
    journal = Journal.install(spool.path, SPOOL_TABLES)
    db = sqlite3.connect(spool.path, isolation_level=None)
    db.execute("BEGIN")
    db.execute("INSERT INTO dropped (trajectory_id, reason, error, time)"
               " VALUES ('x', 'failed', 'e', 0)")
    db.execute("ROLLBACK")
    assert journal.since(0) == []


def test_the_controller_takes_records_in_order_only(tmp_path: Path) -> None:
    spool = Spool(tmp_path / "n.sqlite")
    journal = Journal.install(spool.path, SPOOL_TABLES)
    for i in range(5):
        spool.drop(f"t{i}", "failed", "e")
    received = Received(tmp_path / "received.sqlite")
    records = journal.since(0)

    def send(batch: list) -> int:  # type: ignore[type-arg]
        return received.apply(name="n-0", kind="client", journal=journal.id, records=batch)

    assert send(records[2:]) == 0, "a batch after a gap is refused"
    assert send(records[:2]) == 2
    assert send(records[:2]) == 2, "a batch sent twice (a lost reply) is taken once"
    assert send(records[2:]) == 5
    rows = received.journals("client")[journal.id]
    assert sorted(rows.tables["dropped"]) == [f"t{i}" for i in range(5)] and not rows.final
    received.apply(name="n-0", kind="client", journal=journal.id, records=[], final=True)
    assert received.journals("client")[journal.id].final
    received.close()
    again = Received(tmp_path / "received.sqlite")  # a controller restart keeps what it held
    assert again.held(journal.id) == 5
