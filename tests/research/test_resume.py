"""`jetctl research` started again after a crash of its own: the storage is the state.

Real Optuna sqlite storage and a real run dir's files; no processes: the trial the dead study
left running had finished its run, so the new study adopts it, scores it from its step log,
and starts nothing more (its budget of one trial is spent)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from jetctl.research.runner import StudyRunner, open_study
from jetctl.research.study import load_study

pytestmark = pytest.mark.unit

ROOT = Path(__file__).resolve().parents[2]

STUDY = """\
study: {{name: again, recipe: {recipe}}}
hypothesis: {{statement: adopted trials are scored, metric_at_least: 0.5}}
metric: {{key: reward/mean, last_steps: 2}}
budget: {{trials: 1, max_steps: 3}}
search: {{sampler: random, pruner: none}}
space:
  models.policy.optimizer.lr: {{type: log, low: 1.0e-4, high: 1.0e-2}}
"""


def test_a_restarted_study_adopts_the_trial_its_predecessor_left_running(tmp_path: Path) -> None:
    file = tmp_path / "again.yaml"
    file.write_text(STUDY.format(recipe=ROOT / "recipes" / "tiny.yaml"))
    study = load_study(file)
    study_dir = tmp_path / "again"
    # the dead study: it asked for a trial, its run finished, and it died before `tell`
    before = open_study(study, study_dir)
    trial = before.ask()
    run_dir = study_dir / "trials" / "0000"
    trial.set_user_attr("run_dir", str(run_dir))
    (run_dir / "metrics").mkdir(parents=True)
    (run_dir / "run.json").write_text(json.dumps({"recipe": str(ROOT / "recipes" / "tiny.yaml"),
                                                  "state": "finished"}))
    rows = [{"step": s, "stepped": 1, "reward/mean": r} for s, r in ((1, 0.2), (2, 0.6), (3, 0.8))]
    (run_dir / "metrics" / "policy.steps.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))

    said: list[str] = []
    StudyRunner(study, study_dir, parallel=1, say=said.append).run()

    after = open_study(study, study_dir)
    assert [t.state.name for t in after.trials] == ["COMPLETE"], said
    assert after.trials[0].value == pytest.approx(0.7)  # the mean of the last 2 steps
    assert after.trials[0].user_attrs["events"] == ["the study restarted; the run had finished"]
    assert not any(" started: " in line for line in said), said
