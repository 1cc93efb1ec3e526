"""`jetctl chaos` end to end: a short schedule of every fault, the printout, exit code 0."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from tests.faults.conftest import ROOT, recipe_text

pytestmark = [pytest.mark.integration, pytest.mark.slow, pytest.mark.timeout(900)]


def test_chaos_command_balances(tmp_path: Path) -> None:
    recipe = tmp_path / "recipe.yaml"
    recipe.write_text(recipe_text())
    out = subprocess.run(
        [sys.executable, "-m", "jetctl.cli.main", "chaos", str(recipe), "--duration", "240",
         "--run-dir", str(tmp_path / "run"), "--grace", "20"],
        cwd=ROOT, capture_output=True, text=True, timeout=840, check=False,
    )
    print(out.stdout[-6000:], out.stderr[-3000:])
    assert out.returncode == 0
    for kind in ("server kill -9 mid-batch", "client kill -9", "partition (blackhole)",
                 "drop acks", "server kill -9 mid-checkpoint"):
        assert kind in out.stdout
    assert "BALANCED" in out.stdout and "BAD" not in out.stdout
