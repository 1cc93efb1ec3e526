"""The spool keeps every group until it is acked, across kill -9, and never evicts."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from jetctl.client.spool import Spool

pytestmark = pytest.mark.unit


def test_put_due_ack_defer(tmp_path: Path) -> None:
    spool = Spool(tmp_path / "s.sqlite")
    spool.put("g1", b"a" * 10, 2, now=100.0)
    spool.put("g2", b"b" * 30, 3, now=101.0)
    spool.put("g1", b"ignored", 9, now=102.0)  # same id: no-op
    assert spool.depth() == 2 and spool.bytes() == 40
    assert spool.oldest_age_s(now=110.0) == pytest.approx(10.0)
    assert [g.id for g in spool.due(limit=10, now=101.0)] == ["g1", "g2"]

    spool.defer("g1", 5.0, now=101.0)
    assert [g.id for g in spool.due(limit=10, now=102.0)] == ["g2"]
    assert spool.due(limit=10, now=106.5)[0].attempts in (0, 1)
    assert spool.next_due_at() == pytest.approx(101.0)

    spool.ack("g2", "stale", "lag 9 > 4")
    spool.ack("g2", "accepted")  # a second answer for an acked group changes nothing
    assert spool.depth() == 1 and spool.outcome("g2") == ("stale", "lag 9 > 4")
    spool.drop("t1", "timeout", "killed")
    counts = spool.counts()
    assert counts.outcomes["stale"] == 1 and counts.outcomes["accepted"] == 0
    assert counts.dropped == {"timeout": 1} and counts.pending_groups == 1
    with pytest.raises(ValueError, match="outcome"):
        spool.ack("g1", "lost")  # type: ignore[arg-type]


def test_spool_never_evicts_and_dead_letters_explicitly(tmp_path: Path) -> None:
    spool = Spool(tmp_path / "s.sqlite")
    for i in range(200):
        spool.put(f"g{i}", os.urandom(1024), 2)
    assert spool.depth() == 200 and spool.bytes() == 200 * 1024  # nothing dropped silently
    spool.dead_letter("g0", ["t0", "t1"], "too big")
    assert spool.depth() == 199
    assert sorted(r[:2] for r in spool.dropped_rows()) == [
        ("t0", "dead-letter"),
        ("t1", "dead-letter"),
    ]


def test_put_survives_kill_9(tmp_path: Path) -> None:
    path = tmp_path / "s.sqlite"
    code = textwrap.dedent(
        f"""
        import os, signal
        from jetctl.client.spool import Spool
        s = Spool({str(path)!r})
        s.put("survivor", b"x" * 100, 2)
        os.kill(os.getpid(), signal.SIGKILL)
        """
    )
    proc = subprocess.run([sys.executable, "-c", code], check=False, timeout=60)
    assert proc.returncode == -signal.SIGKILL
    spool = Spool(path)
    due = spool.due(limit=5)
    assert [(g.id, g.payload, g.n_trajectories) for g in due] == [("survivor", b"x" * 100, 2)]
