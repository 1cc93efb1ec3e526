"""Lost acks: the server commits a Submit, then drops the reply (a fault interceptor). The
client resends, hears DUPLICATE, and every group is trained exactly once."""

from __future__ import annotations

import sqlite3
from collections.abc import Callable

import pytest

from jetctl.run.chaos import ChaosRun
from tests.faults.conftest import assert_nothing_lost

pytestmark = [pytest.mark.integration, pytest.mark.timeout(300)]


def test_dropped_acks_are_resent_and_trained_once(chaos_run: Callable[..., ChaosRun]) -> None:
    run = chaos_run()
    run.wait_version("policy", 1)
    rec = run.drop_acks(0.5, 20.0, until_dropped=3)  # the window closes after 3 lost replies
    assert rec.figures["dropped_acks"] > 0, rec.line()
    version = run.version("policy")
    run.wait_version("policy", version + 2)  # keeps training after the fault
    run.quiesce()

    duplicates = 0
    for path in (run.run_dir / "spool").glob("*.sqlite"):
        with sqlite3.connect(path) as db:
            duplicates += db.execute(
                "SELECT COUNT(*) FROM outcomes WHERE outcome='duplicate'").fetchone()[0]
    # every dropped reply was resent and answered DUPLICATE (the last ones may still be
    # pending if their node drained first; the ledger counts those as held by the server)
    ledger = run.ledger()
    assert duplicates + ledger.resent_after_lost_ack // 4 >= 1
    assert_nothing_lost(ledger)
