"""Partition: the clients' link to the server is blackholed (connect hangs, nothing is
refused). Clients with local inference keep rolling out and spooling up to the spool's
watermark (back-pressure, nothing deleted); keepalive notices; after healing the spool
drains in no longer than the outage lasted."""

from __future__ import annotations

from collections.abc import Callable

import pytest

from jetctl.run.chaos import ChaosRun
from tests.faults.conftest import assert_nothing_lost

pytestmark = [pytest.mark.integration]

SPOOL_MAX = 1024  # the smallest watermark: one tiny group crosses it


def _partition(run: ChaosRun, seconds: float) -> None:
    run.wait_version("policy", 2)
    rec = run.partition(seconds)
    f = rec.figures
    assert f["unreachable_seen"], "keepalive / failed calls marked the server unreachable"
    assert f["pending_at_heal"] > 0, "clients kept rolling out and spooling"
    assert f["backpressure_seen"], "the spool reached its watermark"
    # bounded: the watermark plus the groups that were already running when it was crossed
    assert f["peak_spool_bytes"] < SPOOL_MAX + 16 * 1024, f
    assert rec.recovery_s is not None and rec.recovery_s <= seconds, rec.line()
    version = run.version("policy")
    run.wait_version("policy", version + 2)
    run.quiesce()
    assert_nothing_lost(run.ledger())


# 15 s: three times what a node's status needs to say unreachable (a Submit unanswered for
# 5 s, jetctl.client.transport.SILENT_S) and ample for a tiny group to cross the watermark;
# the 60 s outage is the slow tier's
@pytest.mark.timeout(300)
def test_blackhole_15s(chaos_run: Callable[..., ChaosRun]) -> None:
    _partition(chaos_run(inference="local", spool_max_bytes=SPOOL_MAX), 15.0)


@pytest.mark.slow
@pytest.mark.timeout(480)
def test_blackhole_60s(chaos_run: Callable[..., ChaosRun]) -> None:
    _partition(chaos_run(inference="local", spool_max_bytes=SPOOL_MAX), 60.0)
