"""`jetctl bench soak` at a small N: a real server with training on, a real spool and
delivery; every group acked and stored once, one window per `--window` groups with the
figures the issue names, and the server trained on what it got."""

from __future__ import annotations

import json

import pytest
from typer.testing import CliRunner

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
