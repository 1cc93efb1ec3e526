"""The groups in progress that the back-pressure figure counts are a running count (issue
25): `inflight_groups()` equals the distinct groups with rows in `inflight` after starts,
puts, team puts, drops of one trajectory and of the last one, failed groups, a restart's
recovery and a reopen, and `committed_bytes()` runs no query (its cost does not grow with
the rollouts in progress)."""

from __future__ import annotations

import random
from pathlib import Path

import pytest

from jetctl.client.spool import Spool, SpooledGroup

pytestmark = pytest.mark.unit


def _scanned(spool: Spool) -> int:
    return int(spool._db.execute(
        "SELECT COUNT(DISTINCT group_id) FROM inflight").fetchone()[0])


def test_the_groups_in_progress_are_a_running_count(tmp_path: Path) -> None:
    rng = random.Random(25)
    path = tmp_path / "n.sqlite"
    spool = Spool(path)
    spool._db.execute("PRAGMA synchronous=OFF")  # durability is not what this test reads
    running: dict[str, list[str]] = {}  # group -> its trajectories still in progress
    for i in range(300):
        gid = f"g{i}"
        ids = [f"{gid}t{k}" for k in range(rng.randint(1, 3))]
        spool.start(gid, ids, model="policy")
        running[gid] = list(ids)
        if rng.random() < 0.1:  # started again (a retried start): counted once
            spool.start(gid, ids, model="policy")
        gid = rng.choice(sorted(running))
        ids = running[gid]
        what = rng.random()
        if what < 0.3:
            spool.put(gid, bytes(100), len(ids), trajectory_ids=ids, model="policy")
            del running[gid]
        elif what < 0.4:
            spool.put_all([SpooledGroup(gid, bytes(100), ids, "policy")])
            del running[gid]
        elif what < 0.6:  # one trajectory timed out: the group runs on while others do
            spool.drop(ids.pop(), "timeout", "slow", model="policy")
            if not ids:
                del running[gid]
        elif what < 0.7:
            spool.drop_group(gid, "failed", "the task raised")
            del running[gid]
        assert spool.inflight_groups() == _scanned(spool) == len(running)
    assert spool.inflight_groups() > 0
    spool.close()

    reopened = Spool(path)  # a restarted node reads it once at open ...
    assert reopened.inflight_groups() == len(running)
    reopened.put("landed", bytes(300), 1, model="policy")
    # no acks: every group seen is pending, so their mean size is bytes / depth
    expected = reopened.bytes() + len(running) * reopened.bytes() // reopened.depth()
    queries: list[str] = []
    reopened._db.set_trace_callback(queries.append)
    assert reopened.committed_bytes() == expected
    assert queries == [], "committed_bytes() reads no table"
    reopened._db.set_trace_callback(None)
    assert reopened.recover_lost("the node restarted") > 0  # ... and recovers what ran
    assert reopened.inflight_groups() == _scanned(reopened) == 0
    assert reopened.committed_bytes() == reopened.bytes()
    reopened.close()
