"""`jetctl bench soak` at a small N: a real server with training on, a real spool and
delivery; every group acked and stored once, one window per `--window` groups with the
figures the issue names, and the server trained on what it got."""

from __future__ import annotations

import json

import pytest
from typer.testing import CliRunner

from jetctl.bench.soak import SoakResult, SoakWindow
from jetctl.cli.main import build_app

pytestmark = [pytest.mark.integration, pytest.mark.timeout(240)]


def test_soak_pushes_every_group_through_and_reports_each_window() -> None:
    out = CliRunner().invoke(build_app(), ["bench", "soak", "--groups", "300", "--window", "100",
                                   "--json"])
    assert out.exit_code == 0, out.output
    result = json.loads(out.output.strip().splitlines()[-1])
    assert result["nothing_lost"] and result["stored"] == result["acked"] == 300
    windows = result["windows"]
    assert [w["groups"] >= edge for w, edge in zip(windows, (100, 200, 300))] == [True] * 3
    assert windows[-1]["groups"] == 300
    for w in windows:
        assert set(w) >= {"groups", "submit_p50_ms", "submit_p99_ms", "status_ms",
                          "server_rss_mib", "store_bytes", "spool_bytes"}
        assert 0 < w["submit_p50_ms"] <= w["submit_p99_ms"] and w["status_ms"] > 0
        assert w["server_rss_mib"] > 50 and w["store_bytes"] > 0 and w["spool_bytes"] > 0
    assert windows[0]["store_bytes"] < windows[-1]["store_bytes"], "the store grew"
    goals = result["goals"]
    assert [g["what"].split(" at ")[0] for g in goals] == ["submit p99", "status"]
    assert all(g["ratio"] > 0 and g["met"] == (g["ratio"] <= g["bound"]) for g in goals)


def window(groups: int, p99: float, status: float, rss: float) -> SoakWindow:
    return SoakWindow(groups=groups, submit_p50_ms=1.0, submit_p99_ms=p99, status_ms=status,
                      server_rss_mib=rss, store_bytes=1, spool_bytes=1, trained_groups=0)


def test_the_goals_compare_the_end_with_10k_and_the_rss_with_100k() -> None:
    """The verdict a 1M soak prints: the last window's Submit p99 and Status against the first
    window's (10k), its RSS against the first window at or past 100k, not against the
    first (a server's RSS grows while its first groups arrive; that is not a leak)."""
    result = SoakResult(groups=300_000, group_bytes=1024, windows=[
        window(10_000, 10.0, 2.0, 300.0), window(100_000, 12.0, 2.0, 500.0),
        window(200_000, 14.0, 3.5, 540.0), window(300_000, 16.0, 2.9, 560.0)])
    got = {w.split(" at ")[0]: (round(r, 2), met) for w, r, _, met in result.goals()}
    assert got == {"submit p99": (1.6, False), "status": (1.45, True),
                   "server RSS": (1.12, False)}
    result.windows[-1] = window(300_000, 15.0, 2.9, 550.0)
    assert all(met for *_, met in result.goals())
    assert SoakResult(groups=1, group_bytes=1, windows=result.windows[:1]).goals() == []
