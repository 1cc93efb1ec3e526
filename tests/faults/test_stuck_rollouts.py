"""Stuck work: a rollout that never returns (and started a helper process) is killed at
`rollout_timeout_s` with its whole process group, recorded as timeout, and the node keeps
working."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import pytest

from jetctl.run.chaos import ChaosRun
from tests.faults.conftest import assert_nothing_lost

pytestmark = [pytest.mark.integration, pytest.mark.timeout(300)]


def _alive(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except (FileNotFoundError, IndexError):
        return False
    return state not in ("Z", "X")  # a zombie is dead, only not reaped yet


def test_stuck_rollouts_are_killed_with_what_they_started(
    chaos_run: Callable[..., ChaosRun], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    pid_dir = tmp_path / "helpers"
    pid_dir.mkdir()
    monkeypatch.setenv("JETCTL_STUCK_PID_DIR", str(pid_dir))
    # the timeout is all a stuck rollout costs (twice: the wait for the timeouts below and the
    # quiesce, whose drain lets the stuck ones in flight time out). Normal rollouts take a few
    # seconds at most on a busy 2-core machine (a wait for a server still starting does not
    # count against the timeout), and one that timed out would only be one more timeout
    run = chaos_run(agent="agents.stuck:agent", clients=1, rollout_timeout_s=10.0)
    run.wait("a stuck rollout", lambda: len(list(pid_dir.iterdir())) >= 2, 120)
    version = run.version("policy")
    run.wait_version("policy", version + 3)  # the node keeps working around them
    run.wait("the timeouts recorded",
             lambda: (run.node_info("digits-0") or {}).get("dropped", {}).get("timeout", 0) >= 2, 90)
    run.quiesce()

    helpers = [int(p.name) for p in pid_dir.iterdir()]
    assert helpers and not [p for p in helpers if _alive(p)], "killed with its process group"
    ledger = run.ledger()
    assert ledger.dropped["timeout"] >= 2
    assert_nothing_lost(ledger)
