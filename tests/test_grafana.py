"""docs/grafana/jetctl.json queries only metrics the processes export: against the servers'
and client nodes' registries here, and against a live run's /metrics in
tests/test_observability.py."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest
from prometheus_client import generate_latest

from jetctl.client.metrics import ClientMetrics
from jetctl.server.metrics import ServerMetrics

DASHBOARD = Path(__file__).resolve().parents[1] / "docs" / "grafana" / "jetctl.json"
# samples of each family kind (the text format's TYPE line of a counter already ends in _total)
SUFFIXES = {"counter": ("",), "histogram": ("_bucket", "_sum", "_count"), "gauge": ("",),
            "summary": ("_sum", "_count")}


def queried_metrics(path: Path = DASHBOARD) -> set[str]:
    """Every jetctl_* name a panel's PromQL reads."""
    dashboard = json.loads(path.read_text())
    exprs = [t["expr"] for p in dashboard["panels"] for t in p["targets"]]
    return {m for e in exprs for m in re.findall(r"\bjetctl_[a-z_]+", e)}


def exported_metrics(text: str) -> set[str]:
    """Sample names of a /metrics page, with the samples each declared family will have
    (a labelled counter shows no sample until its first label value is seen)."""
    names = set(re.findall(r"^([a-zA-Z_:][a-zA-Z0-9_:]*)[{ ]", text, re.MULTILINE))
    for family, kind in re.findall(r"^# TYPE (\S+) (\S+)$", text, re.MULTILINE):
        names |= {family + s for s in SUFFIXES.get(kind, ("",))}
    return names


@pytest.mark.unit
def test_dashboard_queries_only_metrics_the_registries_declare() -> None:
    declared = exported_metrics(
        generate_latest(ServerMetrics().registry).decode()
        + generate_latest(ClientMetrics().registry).decode())
    queried = queried_metrics()
    assert len(queried) >= 20, queried  # it covers the servers and the clients
    assert queried <= declared, sorted(queried - declared)
    assert exported_metrics("# TYPE h histogram\n") == {"h_bucket", "h_sum", "h_count"}
