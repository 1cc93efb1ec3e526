"""The crash study end to end, as a user runs it: `jetctl research studies/crash.yaml`.

Three builtin:tiny trials over the learning rate run at once, each a real `jetctl up` (a
controller, a server, two digits clients); trial 1's `jetctl up` is killed (kill -9) at step 2
by the study's chaos setting. We check what a user would: the crash was seen and resumed with
`jetctl up --resume`, every trial (the crashed one too) reached its 6 steps, the report ranks
the trials by the metric, and running the study again resumes it rather than starting over.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from jetctl.research.report import trial_rows
from jetctl.research.runner import storage_url

pytestmark = [pytest.mark.integration, pytest.mark.slow, pytest.mark.timeout(1200)]

ROOT = Path(__file__).resolve().parents[2]


def jetctl(*args: str, timeout: float = 900) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "jetctl.cli.main", *args], check=False, cwd=ROOT,
                          capture_output=True, text=True, timeout=timeout,
                          env={**os.environ, "COLUMNS": "200"})


def test_crash_study_resumes_the_crashed_trial_and_ranks_all(tmp_path: Path) -> None:
    study_dir = tmp_path / "crash"
    out = jetctl("research", "studies/crash.yaml", "--dir", str(study_dir))
    assert out.returncode == 0, out.stdout + out.stderr
    assert "trial 1: step 2: chaos killed jetctl up (kill -9)" in out.stdout
    assert re.search(r"trial 1: step \d+: jetctl up crashed \(killed by signal 9\); resumed "
                     r"with jetctl up --resume \(1 of 2\)", out.stdout), out.stdout

    rows = {r.number: r for r in trial_rows(storage_url(study_dir), "crash")}
    assert sorted(rows) == [0, 1, 2]
    for r in rows.values():
        assert r.state == "COMPLETE" and r.value is not None, r
        assert r.steps == 6, f"trial {r.number} stopped at step {r.steps}: {r.events}"
    assert rows[1].resumes == 1 and rows[0].resumes == rows[2].resumes == 0

    # the report ranks by the metric, best first, and says what crashed and how it was handled
    report = (study_dir / "report.md").read_text()
    table = [ln for ln in report.splitlines() if re.match(r"\| \d+ \| \d", ln)]
    ranked = [int(ln.split("|")[2]) for ln in table]
    values = {n: rows[n].value for n in rows}
    assert ranked == sorted(values, key=lambda n: -(values[n] or 0.0)), (ranked, values)
    assert "- trial 1: step 2: chaos killed jetctl up (kill -9)" in report
    assert "resumed with jetctl up --resume" in report
    page = (study_dir / "report.html").read_text()
    assert page.count("<svg") == 3 and "<polyline" in page

    # again: the budget is spent, so nothing starts; the storage is the state
    again = jetctl("research", "studies/crash.yaml", "--dir", str(study_dir), timeout=120)
    assert again.returncode == 0, again.stderr
    assert " started: " not in again.stdout
    assert len(trial_rows(storage_url(study_dir), "crash")) == 3

    status = jetctl("research", "status", str(study_dir), timeout=60)
    assert status.returncode == 0, status.stderr
    assert status.stdout.count("COMPLETE") == 3
