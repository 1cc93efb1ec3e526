"""`jetctl bench scale` end to end on a small scale: every node joins and runs, groups are
accepted, every figure is measured, and the ledger of the run balances."""

from __future__ import annotations

import math
from pathlib import Path

import pytest

from jetctl.bench.scale import run

pytestmark = pytest.mark.integration

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.timeout(300)
def test_a_small_scale_run_measures_everything_and_balances(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(ROOT)  # the nodes import envs/ and agents/ from here
    r = run(nodes=6, hosts=2, seconds=4.0, interval=0.5, warmup_s=6.0, say=lambda _m: None)
    assert r.nodes_running == 6
    assert r.groups > 0 and r.groups_per_s > 0
    assert 0 < r.ack_p50_ms <= r.ack_p99_ms
    figures = (r.server_rss_mb, r.controller_rss_mb, r.status_p50_ms, r.status_p99_ms)
    assert all(f > 0 and math.isfinite(f) for f in figures)
    assert r.ledger_balanced, r.ledger["problems"]
    assert r.ledger["trained"] + r.ledger["in_flight"]["server_buffer"] > 0
    assert r.ledger["awaiting_reports"] == 0
