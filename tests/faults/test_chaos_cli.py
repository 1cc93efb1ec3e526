"""`jetctl chaos` end to end: the printout and exit code 0 after one round of every fault
kind (CI, `--faults 7`) and after two rounds and more (600 s, slow)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from tests.faults.conftest import ROOT, recipe_text

pytestmark = [pytest.mark.integration, pytest.mark.timeout(900)]


def chaos(
    tmp_path: Path, duration_s: int, faults: int | None = None
) -> subprocess.CompletedProcess[str]:
    recipe = tmp_path / "recipe.yaml"
    recipe.write_text(recipe_text())
    out = subprocess.run(
        [sys.executable, "-m", "jetctl.cli.main", "chaos", str(recipe), "--duration",
         str(duration_s), "--run-dir", str(tmp_path / "run"), "--grace", "20",
         *(["--faults", str(faults)] if faults is not None else [])],
        cwd=ROOT, capture_output=True, text=True, timeout=duration_s + 400, check=False,
    )
    print(out.stdout[-6000:], out.stderr[-3000:])
    return out


EVERY_FAULT = ("server kill -9 mid-batch", "client kill -9 mid-rollout", "partition (blackhole)",
               "drop acks", "server kill -9 mid-checkpoint", "partition (reset)")


def assert_every_fault_recovered(out: subprocess.CompletedProcess[str]) -> None:
    assert out.returncode == 0
    for kind in EVERY_FAULT:
        assert kind in out.stdout, kind
    assert "fault not injected" not in out.stdout
    assert "BALANCED" in out.stdout and "BAD" not in out.stdout


def test_one_round_of_every_fault_balances(tmp_path: Path) -> None:
    """The CI tier's chaos: the schedule's seven faults once each (the server killed mid-batch
    and mid-checkpoint, both clients killed mid-rollout, a blackhole and a reset partition, 30%
    of acks dropped), then the quiesce; each fault must recover within its budget and the
    ledger balance. --duration only bounds it (--faults 7 quiesces after the seventh)."""
    assert_every_fault_recovered(chaos(tmp_path, 330, faults=7))


@pytest.mark.slow
@pytest.mark.timeout(1200)
def test_chaos_command_balances(tmp_path: Path) -> None:
    """Faults round-robin for 600 s: every kind twice or more, then the ledger."""
    assert_every_fault_recovered(chaos(tmp_path, 600))
