"""The study report from a real Optuna sqlite storage and real step-log files: ranking, the
hypothesis verdict, crashes listed, curves inline."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from jetctl.research.report import hypothesis_verdict, ranked, trial_rows, write_report
from jetctl.research.runner import open_study, storage_url
from jetctl.research.study import load_study

pytestmark = pytest.mark.unit

ROOT = Path(__file__).resolve().parents[2]


def _study_file(tmp_path: Path) -> Path:
    text = (ROOT / "studies" / "learning-rate.yaml").read_text()
    file = tmp_path / "lr.yaml"
    file.write_text(text.replace("../recipes/quickstart.yaml", str(ROOT / "recipes" / "quickstart.yaml")))
    return file


def _steps(run_dir: Path, rewards: list[float]) -> None:
    (run_dir / "metrics").mkdir(parents=True)
    rows = [{"step": i + 1, "stepped": 1, "time": float(i), "reward/mean": r}
            for i, r in enumerate(rewards)]
    (run_dir / "metrics" / "policy.steps.jsonl").write_text(
        "".join(json.dumps(r) + "\n" for r in rows))


def test_report_ranks_by_the_metric_and_judges_against_the_base(tmp_path: Path) -> None:
    study = load_study(_study_file(tmp_path))
    ostudy = open_study(study, tmp_path / "study")  # trial 0 is the base (include_base)
    # (lr, final metric or None for a pruned trial, events)
    plan = [(5e-4, 0.50, []), (1e-3, 0.72, ["step 4: jetctl up crashed (exit code 1); resumed"]),
            (3e-3, None, ["stopped: diverged: loss = nan at step 3 (limit 1e+04)"]), (2e-4, 0.31, [])]
    for lr, value, events in plan:
        trial = ostudy.ask({"models.policy.optimizer.lr": _dist(lr)})
        run_dir = tmp_path / "study" / "trials" / f"{trial.number:04d}"
        _steps(run_dir, [0.1, 0.2, value if value is not None else 0.05])
        trial.set_user_attr("run_dir", str(run_dir))
        trial.set_user_attr("events", events)
        if value is None:
            trial.report(0.05, 3)
            ostudy.tell(trial, state=_state().PRUNED)
        else:
            ostudy.tell(trial, value)
    rows = trial_rows(storage_url(tmp_path / "study"), study.name)
    assert rows[0].base and rows[0].params["models.policy.optimizer.lr"] == 5e-4
    assert [r.number for r in ranked(rows, maximize=True)] == [1, 0, 3, 2]
    held, why = hypothesis_verdict(study, rows)
    assert held is True and "margin +0.220" in why, why

    md, page = write_report(study, tmp_path / "study", rows)
    text = md.read_text()
    assert "verdict: **held**" in text
    assert "| 1 | 1 | lr=0.001 | 0.720 | COMPLETE |" in text
    assert "| 4 | 2 | lr=0.003 | 0.050 | PRUNED |" in text  # its last reported value
    assert "- trial 2: stopped: diverged: loss = nan at step 3" in text
    html = page.read_text()
    assert html.count("<svg") == 4 and "<table>" in html and "</table>" in html


def _dist(lr: float) -> object:
    import optuna

    return optuna.distributions.FloatDistribution(lr, lr)


def _state() -> Any:
    import optuna

    return optuna.trial.TrialState
