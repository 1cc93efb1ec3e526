"""The spool's back-pressure figure is a running count (issue 25): `bytes()` equals the
pending payloads' sum after puts, re-puts, acks, a second ack, dead letters and a reopen, and
reading it runs no query (its cost does not grow with the spool)."""

from __future__ import annotations

import random
from pathlib import Path

import pytest

from jetctl.client.spool import Spool, SpooledGroup

pytestmark = pytest.mark.unit


def _scanned(spool: Spool) -> int:
    return int(spool._db.execute(
        "SELECT COALESCE(SUM(LENGTH(payload)), 0) FROM pending").fetchone()[0])


def test_bytes_is_a_running_count_equal_to_the_pending_payloads(tmp_path: Path) -> None:
    rng = random.Random(25)
    path = tmp_path / "n.sqlite"
    spool = Spool(path)
    pending: list[str] = []
    for i in range(200):
        gid = f"g{i}"
        payload = bytes(rng.randint(10, 5000))
        if rng.random() < 0.5:
            spool.put(gid, payload, 2, trajectory_ids=[f"{gid}a", f"{gid}b"])
        else:
            spool.put_all([SpooledGroup(gid, payload, [f"{gid}a", f"{gid}b"], "policy")])
        pending.append(gid)
        if rng.random() < 0.1:  # a re-put of a pending id changes nothing
            spool.put(gid, bytes(99_999), 2)
        if pending and rng.random() < 0.4:
            done = pending.pop(rng.randrange(len(pending)))
            spool.ack(done, "accepted")
            spool.ack(done, "accepted")  # answered twice: counted once
        if pending and rng.random() < 0.05:
            lost = pending.pop(rng.randrange(len(pending)))
            spool.dead_letter(lost, [f"{lost}a", f"{lost}b"], "too large")
        assert spool.bytes() == _scanned(spool)
    assert spool.bytes() > 0
    spool.close()
    reopened = Spool(path)
    assert reopened.bytes() == _scanned(reopened)

    queries: list[str] = []
    reopened._db.set_trace_callback(queries.append)
    reopened.bytes()
    assert queries == [], "bytes() reads no table"
    reopened.close()
