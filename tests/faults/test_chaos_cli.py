"""`jetctl chaos` end to end: the printout and exit code 0 after its first fault (CI,
`--faults 1`) and after a schedule of every fault (240 s, slow)."""

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
        cwd=ROOT, capture_output=True, text=True, timeout=840, check=False,
    )
    print(out.stdout[-6000:], out.stderr[-3000:])
    return out


def test_a_short_chaos_run_balances(tmp_path: Path) -> None:
    """The CI tier's chaos: the first fault (kill -9 of the server mid-batch), then the
    quiesce; --duration only bounds it (a slow start still leaves the fault its 60 s)."""
    out = chaos(tmp_path, 240, faults=1)
    assert out.returncode == 0
    assert "server kill -9 mid-batch" in out.stdout
    assert "BALANCED" in out.stdout and "BAD" not in out.stdout


@pytest.mark.slow
def test_chaos_command_balances(tmp_path: Path) -> None:
    out = chaos(tmp_path, 240)
    assert out.returncode == 0
    for kind in ("server kill -9 mid-batch", "client kill -9", "partition (blackhole)",
                 "drop acks", "server kill -9 mid-checkpoint"):
        assert kind in out.stdout
    assert "BALANCED" in out.stdout and "BAD" not in out.stdout
