"""A week-long node's spool stays bounded (issue 25): acked groups' outcome rows past the
newest `keep_outcomes` are folded into per-(model, outcome) totals, and every total a user
reads (the spool's counts, the ledger from the files and from the controller's copy) is the
same before and after the fold; an old spool file migrates on open; and the back-pressure
figure counts the groups in flight, so they cannot carry the spool past its watermark."""

from __future__ import annotations

import sqlite3
from pathlib import Path
from typing import Any

import pytest

from jetctl.client.spool import Spool
from jetctl.journal import SPOOL_TABLES, Journal
from jetctl.proto.convert import group_to_pb
from jetctl.run.ledger import ledger_from_files
from tests.factories import make_group
from tests.run.test_ledger import _received, _store, _submit

pytestmark = pytest.mark.unit


def _ack_many(spool: Spool, first: int, n: int, outcome: str = "accepted") -> None:
    for i in range(first, first + n):
        spool.put(f"g{i}", bytes(100), 2, trajectory_ids=[f"g{i}a", f"g{i}b"], model="policy")
        spool.ack(f"g{i}", outcome)  # type: ignore[arg-type]


def _file_bytes(spool: Spool) -> int:
    spool._db.execute("PRAGMA wal_checkpoint(TRUNCATE)")
    return spool.path.stat().st_size


def test_counts_are_the_same_after_folding_and_the_spool_stops_growing(tmp_path: Path) -> None:
    spool = Spool(tmp_path / "n.sqlite", keep_outcomes=100)
    spool._db.execute("PRAGMA synchronous=OFF")  # durability is not what this test reads
    _ack_many(spool, 0, 500)
    _ack_many(spool, 500, 40, "stale")
    _ack_many(spool, 540, 30, "invalid")
    spool.put("waiting", bytes(10), 2, trajectory_ids=["w1", "w2"], model="policy")
    expected = {"accepted": 500, "duplicate": 0, "stale": 40, "invalid": 30, "revision": 0}
    assert spool.counts().outcomes == expected
    rows = spool._db.execute("SELECT COUNT(*) FROM outcomes").fetchone()[0]
    assert rows <= 100 + 10, "older rows were folded in batches of a tenth of what is kept"
    assert spool.compact() > 0 and spool.counts().outcomes == expected
    assert spool.outcome("g569") == ("invalid", ""), "the newest rows stay rows"
    assert spool.outcome("g0") is None, "a folded group's row is gone"
    assert sum(t.trajectories for t in spool.outcome_totals()) == 2 * (570 - 100)
    assert spool.depth() == 1 and spool.counts().pending_bytes == 10, "pending untouched"

    size = _file_bytes(spool)
    _ack_many(spool, 1000, 3000)  # six times as many acks again
    assert spool.counts().outcomes["accepted"] == 3500
    assert _file_bytes(spool) <= size * 1.2, "the file does not grow with the run's age"
    spool.close()
    reopened = Spool(tmp_path / "n.sqlite", keep_outcomes=100)
    assert reopened.counts().outcomes == {**expected, "accepted": 3500}
    reopened.close()


def test_a_spool_written_before_the_fold_migrates_on_open(tmp_path: Path) -> None:
    path = tmp_path / "old.sqlite"
    db = sqlite3.connect(path)  # the first release's tables: no totals, no model, no ids
    db.executescript(
        "CREATE TABLE pending (id TEXT PRIMARY KEY, payload BLOB NOT NULL, n_trajectories "
        "INTEGER NOT NULL, created_at REAL NOT NULL, attempts INTEGER NOT NULL DEFAULT 0, "
        "next_attempt_at REAL NOT NULL);"
        "CREATE TABLE outcomes (group_id TEXT PRIMARY KEY, n_trajectories INTEGER NOT NULL, "
        "outcome TEXT NOT NULL, reason TEXT NOT NULL, time REAL NOT NULL);"
    )
    db.executemany("INSERT INTO outcomes VALUES (?, 4, ?, '', 0)",
                   [(f"old{i}", "accepted" if i % 3 else "stale") for i in range(60)])
    db.commit()
    db.close()
    spool = Spool(path, keep_outcomes=10)
    assert spool.counts().outcomes["accepted"] == 40 and spool.counts().outcomes["stale"] == 20
    _ack_many(spool, 0, 1)  # the next ack folds the old rows
    assert spool._db.execute("SELECT COUNT(*) FROM outcomes").fetchone()[0] <= 11
    assert spool.counts().outcomes["accepted"] == 41 and spool.counts().outcomes["stale"] == 20
    assert spool.label_unlabelled("policy") == 0
    by_key = {(t.model, t.outcome): t for t in spool.outcome_totals()}
    assert set(by_key) == {("policy", "accepted"), ("policy", "stale")}, "labelled on start"
    assert sum(t.trajectories for t in by_key.values()) == 51 * 4, "61 rows, the newest 10 kept"
    assert spool.counts().outcomes["accepted"] == 41 and spool.counts().outcomes["stale"] == 20
    spool.close()


@pytest.mark.parametrize("how", ["files", "received"])
def test_the_ledger_is_the_same_before_and_after_the_fold(tmp_path: Path, how: str) -> None:
    store = _store(tmp_path)
    spool = Spool(tmp_path / "spool" / "digits-0.sqlite", keep_outcomes=1_000)
    Journal.install(spool.path, SPOOL_TABLES)
    groups = [make_group() for _ in range(12)]
    for g in groups:
        ids = [t.id for t in g.trajectories]
        spool.start(g.id, ids, model="policy")
        spool.put(g.id, group_to_pb(g).SerializeToString(), len(ids), trajectory_ids=ids,
                  model="policy")
    trained, buffered, stale, invalid, lost_ack, _pending = (groups[2 * i: 2 * i + 2]
                                                            for i in range(6))
    for g in trained + buffered:
        _submit(store, spool, g)
    store.take(2, 1.0)
    store.mark_trained([g.id for g in trained], step=1)
    for g in stale:
        _submit(store, spool, g, outcome="stale")
    for g in invalid:
        spool.ack(g.id, "invalid", "invalid: token outside the vocab")  # never stored
    for g in lost_ack:
        _submit(store, None, g)  # committed; the reply never arrived
    server_only = make_group()
    store.put(server_only, group_to_pb(server_only).SerializeToString(), "accepted").result(5)
    build = ledger_from_files if how == "files" else _received
    before = build(tmp_path).summary()
    assert before["balanced"] and before["server_only"] == 2, before["problems"]

    assert spool.compact(keep=1) == 7, "all acks but the newest folded"
    after = build(tmp_path).summary()
    assert after == before


def test_a_folded_ack_no_server_holds_is_still_lost(tmp_path: Path) -> None:
    _store(tmp_path)
    spool = Spool(tmp_path / "spool" / "digits-0.sqlite", keep_outcomes=0)
    g = make_group()
    ids = [t.id for t in g.trajectories]
    spool.put(g.id, b"x", len(ids), trajectory_ids=ids, model="policy")
    spool.ack(g.id, "accepted")  # an ack without the durable write behind it; folded at once
    assert spool.outcome(g.id) is None
    ledger = ledger_from_files(tmp_path)
    assert not ledger.balanced and ledger.count("lost") == len(ids)


def _spool_until_full(spool: Spool, limit: int, group_bytes: int, slots: int,
                      figure: Any) -> int:
    """A producer that starts a group while `figure()` is at most `limit` and `slots` groups
    run at once; every group lands after the next start. Returns the spool's peak bytes."""
    running: list[str] = []
    peak, started = 0, 0
    for _ in range(200):
        if figure() <= limit and len(running) < slots:
            gid = f"g{started}"
            spool.start(gid, [f"{gid}a"], model="policy")
            running.append(gid)
            started += 1
        elif running:
            gid = running.pop(0)
            spool.put(gid, bytes(group_bytes), 1, trajectory_ids=[f"{gid}a"], model="policy")
            peak = max(peak, spool.bytes())
    for gid in running:
        spool.put(gid, bytes(group_bytes), 1, trajectory_ids=[f"{gid}a"], model="policy")
        peak = max(peak, spool.bytes())
    return peak


def test_the_groups_in_flight_cannot_carry_the_spool_past_its_watermark(tmp_path: Path) -> None:
    limit, size, slots = 10_000, 1_000, 8
    seeded = Spool(tmp_path / "a.sqlite")
    seeded.put("first", bytes(size), 1, model="policy")  # one group landed: its size known
    peak = _spool_until_full(seeded, limit, size, slots, seeded.committed_bytes)
    assert peak <= limit + size, "at most the one group started just under the mark"
    old = Spool(tmp_path / "b.sqlite")
    old.put("first", bytes(size), 1, model="policy")
    overshoot = _spool_until_full(old, limit, size, slots, old.bytes)
    assert overshoot >= limit + (slots - 1) * size, "the check before: every group in flight"
