"""kill -9 of a client node mid-rollout: the controller restarts it, its spool is delivered,
the rollouts it was running are recorded as dropped(lost), and no group is half-sent."""

from __future__ import annotations

from collections.abc import Callable

import pytest

from jetctl.run.chaos import ChaosRun
from tests.faults.conftest import assert_nothing_lost

pytestmark = [pytest.mark.integration, pytest.mark.timeout(300)]


def test_client_kill_mid_rollout(chaos_run: Callable[..., ChaosRun]) -> None:
    run = chaos_run(clients=1)
    run.wait_version("policy", 2)
    rec = run.kill_client("digits-0")
    assert rec.recovery_s is not None, rec.line()
    assert rec.figures["rollouts_in_flight"] > 0, "the kill landed mid-rollout"
    assert rec.figures["recorded_lost"] > 0, rec.line()
    # the restarted node keeps producing; what it had spooled is delivered
    pending = run.spool_pending()
    version = run.version("policy")
    run.wait_version("policy", version + 3)
    run.wait("the old spool delivered", lambda: not (pending & run.spool_pending()), 60)

    run.quiesce()
    ledger = run.ledger()
    assert ledger.dropped["lost"] == rec.figures["recorded_lost"]
    assert_nothing_lost(ledger)
