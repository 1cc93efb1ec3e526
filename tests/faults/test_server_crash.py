"""kill -9 of a swarm server mid-batch and mid-checkpoint: the controller restarts it on the
same port, it resumes from its last complete checkpoint (the torn one is ignored), reloads
accepted-but-untrained groups, recognises resent groups, and nothing is lost."""

from __future__ import annotations

from collections.abc import Callable

import pytest

from jetctl.run.chaos import SERVER_RESTART_BUDGET_S, ChaosRun, checkpoint_versions
from tests.faults.conftest import assert_nothing_lost

pytestmark = [pytest.mark.integration, pytest.mark.timeout(420)]


def test_server_kill_mid_batch_and_mid_checkpoint(chaos_run: Callable[..., ChaosRun]) -> None:
    run = chaos_run()
    run.wait_version("policy", 6)  # past the first checkpoint (every 5 steps)

    batch = run.kill_server("policy", during="batch")
    assert batch.recovery_s is not None and batch.recovery_s <= SERVER_RESTART_BUDGET_S, batch.line()
    assert batch.figures["resumed_from"] == batch.figures["checkpoint"] >= 5, batch.line()
    run.wait_version("policy", batch.figures["resumed_from"] + 2)  # training continues

    ckpt = run.kill_server("policy", during="checkpoint")
    assert ckpt.figures["partial"], "the kill landed while a checkpoint was being written"
    assert ckpt.recovery_s is not None and ckpt.recovery_s <= SERVER_RESTART_BUDGET_S, ckpt.line()
    # the torn checkpoint is not loaded: the last complete one is
    torn = int(ckpt.figures["partial"][0].removeprefix("step-").removesuffix(".partial"))
    assert ckpt.figures["resumed_from"] == ckpt.figures["checkpoint"] < torn, ckpt.line()
    resumed = ckpt.figures["resumed_from"]
    run.wait_version("policy", resumed + 2)
    assert not list(run.checkpoint_dir("policy").glob("*.partial")) or checkpoint_versions(
        run.checkpoint_dir("policy"))[-1] > resumed

    run.quiesce()
    assert run.resumed_from("policy")[:3] == [0, batch.figures["resumed_from"], resumed]
    assert_nothing_lost(run.ledger())
