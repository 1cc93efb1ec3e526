"""A real run for the tests that need one: `jetctl ...` as the user types it, a detached run
that is downed on the way out whatever happened, its live status, the step rows its server
wrote so far (typed: jetctl.rundir.StepRow).

    with detached_run(recipe, tmp_path / "run") as run_dir:
        ...  # poll step_rows(run_dir), run_status(run_dir), jetctl("logs", str(run_dir))

`env` (jetctl, detached_run, run_status): the whole environment of the child, None for this
process's; a run's nodes inherit the controller's, so `up` is where an agent's setting goes.
"""

from __future__ import annotations

import json
import subprocess
import sys
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from jetctl.rundir import RunDirError, RunPaths, StepRow, read_run_record, read_step_rows

ROOT = Path(__file__).resolve().parents[1]


def jetctl(
    *args: str, check: bool = True, timeout_s: float = 300, env: Mapping[str, str] | None = None,
) -> subprocess.CompletedProcess[str]:
    """The CLI in a child, from the repository root (where `tests.` and `envs.` import)."""
    return subprocess.run([sys.executable, "-m", "jetctl.cli.main", *args], cwd=ROOT,
                          capture_output=True, text=True, timeout=timeout_s, check=check,
                          env=None if env is None else dict(env))


@contextmanager
def detached_run(
    recipe: Path, run_dir: Path, env: Mapping[str, str] | None = None,
) -> Iterator[Path]:
    """`jetctl up --detach` of `recipe` in `run_dir`; `jetctl down` on the way out, unless
    the run has finished (a test that downed it itself, and checked how, is done with it:
    a second down of a finished run would rewrite its stop reason)."""
    try:
        up = jetctl("up", str(recipe), "--detach", "--run-dir", str(run_dir), check=False,
                    env=env)
        assert up.returncode == 0, up.stdout + up.stderr
        yield run_dir
    finally:
        if not _finished(run_dir):
            jetctl("down", "--run-dir", str(run_dir), check=False, env=env)


def _finished(run_dir: Path) -> bool:
    try:
        return read_run_record(run_dir).state == "finished"
    except RunDirError:  # no run.json: `up` failed before the controller wrote one
        return False


def run_status(run_dir: Path, env: Mapping[str, str] | None = None) -> dict[str, Any] | None:
    """`jetctl status --once --json`: the live document (a finished run's summary); None when
    the command failed (a controller not answering yet)."""
    out = jetctl("status", "--once", "--json", "--run-dir", str(run_dir), check=False, env=env)
    return dict(json.loads(out.stdout)) if out.returncode == 0 else None


def step_rows(run_dir: Path, model: str = "policy") -> list[StepRow]:
    """The rows of `model`'s step log, up to the last whole line."""
    return read_step_rows(RunPaths(run_dir).steps_log(model))
