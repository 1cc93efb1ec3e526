"""A real run for the tests that need one: `jetctl ...` as the user types it, a detached run
that is downed on the way out whatever happened, the step rows its server wrote so far.

    with detached_run(recipe, tmp_path / "run") as run_dir:
        ...  # poll step_rows(run_dir), jetctl("status", ...)
"""

from __future__ import annotations

import json
import subprocess
import sys
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from jetctl.rundir import RunPaths

ROOT = Path(__file__).resolve().parents[1]


def jetctl(
    *args: str, check: bool = True, timeout_s: float = 300
) -> subprocess.CompletedProcess[str]:
    """The CLI in a child, from the repository root (where `tests.` and `envs.` import)."""
    return subprocess.run([sys.executable, "-m", "jetctl.cli.main", *args], cwd=ROOT,
                          capture_output=True, text=True, timeout=timeout_s, check=check)


@contextmanager
def detached_run(recipe: Path, run_dir: Path) -> Iterator[Path]:
    """`jetctl up --detach` of `recipe` in `run_dir`; `jetctl down` on the way out."""
    try:
        up = jetctl("up", str(recipe), "--detach", "--run-dir", str(run_dir), check=False)
        assert up.returncode == 0, up.stdout + up.stderr
        yield run_dir
    finally:
        jetctl("down", "--run-dir", str(run_dir), check=False)


def step_rows(run_dir: Path, model: str = "policy") -> list[dict[str, Any]]:
    """The rows of `model`'s step log, up to the last whole line."""
    path = RunPaths(run_dir).steps_log(model)
    if not path.is_file():
        return []
    lines = path.read_text().split("\n")[:-1]  # after the last newline: a row half written
    return [json.loads(line) for line in lines if line.strip()]
