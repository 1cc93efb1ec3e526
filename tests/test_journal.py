"""A spool's journal records every change the ledger reads, in the change's own transaction,
and a controller's copy takes the records only in order. The journal is bounded: the node
prunes what the controller holds, and a controller that lost its copy (or part of it) gets
a snapshot from which it rebuilds the same ledger."""

from __future__ import annotations

import shutil
import sqlite3
from pathlib import Path

import pytest

from jetctl.client.spool import Spool
from jetctl.controller.received import Received
from jetctl.journal import JOURNAL_TABLE, PRUNE_BATCH, SPOOL_TABLES, STORE_TABLES, Journal
from jetctl.proto.convert import group_to_pb
from jetctl.run.ledger import build_ledger, ledger_from_files
from jetctl.rundir import RunPaths
from tests.factories import make_group
from tests.run.test_ledger import _store, _submit

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


# -- bounded: pruning what the controller holds, snapshots for a controller that lost it ---


def _sync(received: Received, journal: Journal, name: str = "n-0", kind: str = "client",
          prune_batch: int = 1, final: bool = False) -> int:
    """What a node's link does at a sync (jetctl.link): send the records after what the
    controller holds, in batches, and prune up to what each reply says it holds."""
    held = received.held(journal.id)
    while batch := journal.since(held, limit=50):
        held = received.apply(name=name, kind=kind, journal=journal.id, records=batch)
        journal.prune(held, batch=prune_batch)
    received.apply(name=name, kind=kind, journal=journal.id, records=[], final=final)
    return held


def _ack_many(spool: Spool, first: int, n: int, outcome: str = "accepted") -> None:
    for i in range(first, first + n):
        ids = [f"g{i}a", f"g{i}b"]
        spool.start(f"g{i}", ids, model="policy")
        spool.put(f"g{i}", bytes(10), 2, trajectory_ids=ids, model="policy")
        spool.ack(f"g{i}", outcome)  # type: ignore[arg-type]


def _journal_rows(spool: Spool) -> int:
    return int(spool._db.execute(f"SELECT COUNT(*) FROM {JOURNAL_TABLE}").fetchone()[0])


def _acked_groups(received: Received, journal: Journal) -> int:
    """Acked groups in the controller's copy: the rows kept and the folded totals."""
    tables = received.journals("client")[journal.id].tables
    folded = sum(int(t["groups"]) for t in tables.get("outcome_totals", {}).values())
    return folded + len(tables.get("outcomes", {}))


def _reopen_empty(received: Received) -> Received:
    """The controller's copy deleted (a controller started over on a fresh run dir copy)."""
    received.close()
    for suffix in ("", "-wal", "-shm"):
        Path(f"{received.path}{suffix}").unlink(missing_ok=True)
    return Received(received.path)


def test_a_journal_the_controller_takes_stays_bounded_while_the_run_grows(
    tmp_path: Path,
) -> None:
    spool = Spool(tmp_path / "n.sqlite", keep_outcomes=100)  # folds, as a week-long run does
    spool._db.execute("PRAGMA synchronous=OFF")  # durability is not what this test reads
    journal = Journal.install(spool.path, SPOOL_TABLES)
    received = Received(tmp_path / "received.sqlite")
    sizes: list[int] = []
    for r in range(30):  # 3,000 groups, a sync after every 100
        _ack_many(spool, 100 * r, 100)
        _sync(received, journal, prune_batch=PRUNE_BATCH)
        sizes.append(_journal_rows(spool))
    assert journal.last_seq() > 20 * PRUNE_BATCH, "unpruned, the journal would hold them all"
    assert max(sizes) < PRUNE_BATCH, f"what the controller holds goes, in batches: {sizes}"
    assert received.held(journal.id) == journal.last_seq()
    assert _acked_groups(received, journal) == 3_000, "the copy's totals survive the fold"
    assert spool.counts().outcomes["accepted"] == 3_000


def test_an_ask_from_below_what_was_pruned_gets_one_snapshot(tmp_path: Path) -> None:
    spool = Spool(tmp_path / "n.sqlite")
    journal = Journal.install(spool.path, SPOOL_TABLES)
    for i in range(5):
        spool.drop(f"t{i}", "failed", "e")  # seq 1-5
    spool.start("g1", ["a"])  # seq 6
    assert journal.prune(3, batch=10) == 0, "fewer than a batch: kept for now"
    assert journal.prune(3, batch=1) == 3 and journal.pruned() == 3
    assert [r.seq for r in journal.since(3)] == [4, 5, 6], "from the mark on: as before"

    snapshot = journal.since(0)  # a controller that holds nothing
    assert [(r.op, r.table, r.key) for r in snapshot] == [
        ("reset", "", ""), ("put", "inflight", "a"),
        *[("put", "dropped", f"t{i}") for i in range(5)],
    ]
    assert snapshot[0].seq == 7, "after every record ever given: seqs only grow"
    assert journal.since(2) == snapshot, "a second ask reuses the snapshot"
    assert journal.prune(10**9, batch=1) == 10 and journal.pruned() == 13, (
        "never beyond the last record written"
    )
    assert journal.since(13) == [] and journal.last_seq() == 13
    again = journal.since(0)
    assert again[0].op == "reset" and again[0].seq == 14, "the old snapshot was pruned too"


def test_a_journal_installed_before_pruning_gains_its_mark(tmp_path: Path) -> None:
    spool = Spool(tmp_path / "n.sqlite")
    db = sqlite3.connect(spool.path, isolation_level=None)  # the first release's journal
    db.execute(f"CREATE TABLE {JOURNAL_TABLE} (seq INTEGER PRIMARY KEY AUTOINCREMENT, "
               "tbl TEXT NOT NULL, op TEXT NOT NULL, key TEXT NOT NULL, data TEXT)")
    db.execute(f"CREATE TABLE {JOURNAL_TABLE}_meta (id TEXT NOT NULL)")
    db.execute(f"INSERT INTO {JOURNAL_TABLE}_meta (id) VALUES ('old-id')")
    db.close()
    journal = Journal.install(spool.path, SPOOL_TABLES)
    spool.drop("t0", "failed", "e")
    spool.drop("t1", "failed", "e")
    assert journal.id == "old-id" and journal.pruned() == 0
    assert journal.prune(1, batch=1) == 1 and [r.key for r in journal.since(1)] == ["t1"]


def test_a_controller_copy_rebuilt_after_pruning_gives_the_same_ledger(tmp_path: Path) -> None:
    store = _store(tmp_path)
    spool = Spool(tmp_path / "spool" / "digits-0.sqlite", keep_outcomes=3)
    journals = [
        (Journal.install(spool.path, SPOOL_TABLES), "digits-0", "client"),
        (Journal.install(store.path, STORE_TABLES), "policy", "server"),
    ]
    received = Received(RunPaths(tmp_path).received)

    def sync_all(final: bool = False) -> None:
        for journal, name, kind in journals:
            _sync(received, journal, name=name, kind=kind, final=final)

    groups = [make_group() for _ in range(10)]
    for i, g in enumerate(groups):
        ids = [t.id for t in g.trajectories]
        spool.start(g.id, ids, model="policy")
        spool.put(g.id, group_to_pb(g).SerializeToString(), len(ids), trajectory_ids=ids,
                  model="policy")
        if i < 6:
            _submit(store, spool, g)
        elif i < 8:
            _submit(store, spool, g, outcome="stale")
        sync_all()  # the node syncs while it works: pruned as it goes
    store.take(3, 1.0)
    store.mark_trained([g.id for g in groups[:3]], step=1)
    spool.start("g-running", ["r1", "r2"], model="policy")
    spool.start("g-timeout", ["x1"], model="policy")
    spool.drop("x1", "timeout", "killed at rollout_timeout_s", model="policy")
    sync_all(final=True)
    assert spool.outcome_totals(), "the spool folded acks"
    assert all(j.pruned() == j.last_seq() for j, _, _ in journals), "all taken, all pruned"
    before = build_ledger(tmp_path).summary()
    assert before["balanced"] and before["trained"] == 6, before
    assert before == ledger_from_files(tmp_path).summary()

    received = _reopen_empty(received)
    sync_all(final=True)  # each node answers from a snapshot
    assert build_ledger(tmp_path).summary() == before


def test_a_controller_that_lost_what_the_node_pruned_loses_nothing(tmp_path: Path) -> None:
    """The crash between prune and ack: the controller committed, the node pruned on its
    reply, then the controller's host lost that commit (synchronous=NORMAL survives a
    process, not the OS): its copy is back at an older seq, with rows since deleted."""
    spool = Spool(tmp_path / "n.sqlite", keep_outcomes=2)
    journal = Journal.install(spool.path, SPOOL_TABLES)
    received = Received(tmp_path / "received.sqlite")
    for i in range(6):
        spool.put(f"g{i}", bytes(10), 2, trajectory_ids=[f"g{i}a", f"g{i}b"], model="policy")
    spool.drop("t0", "failed", "e", model="policy")
    _sync(received, journal)
    received.close()  # the copy as the OS kept it: six groups pending, one dropped
    shutil.copy(received.path, tmp_path / "kept.sqlite")
    received = Received(received.path)

    for i in range(6):
        spool.ack(f"g{i}", "accepted")  # pending rows deleted, outcome rows folded
    spool.drop("t1", "timeout", "e", model="policy")
    _sync(received, journal)
    assert journal.pruned() == journal.last_seq(), "the node pruned on the controller's word"
    received.close()
    shutil.copy(tmp_path / "kept.sqlite", received.path)
    received = Received(received.path)
    assert 0 < received.held(journal.id) < journal.pruned()

    # the node (restarted: the same journal) asks again from what the copy holds
    restarted = Journal.install(spool.path, SPOOL_TABLES)
    assert restarted.id == journal.id
    _sync(received, restarted)
    tables = received.journals("client")[journal.id].tables
    assert not tables.get("pending"), "acked groups are not pending in the copy"
    assert _acked_groups(received, journal) == 6
    assert set(tables["dropped"]) == {"t0", "t1"}
    assert received.held(journal.id) == journal.last_seq()
