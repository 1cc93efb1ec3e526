"""A study's budget in cost (budget.trial_cpu_s, trial_usd, study_cpu_s, study_usd) read from
each trial's ledger (jetctl/costs.py over its step log). Real Optuna storage and run-dir
files; the trial's `jetctl up` is not started (its step log is written here), its stop is the
real `jetctl down` (a `sleep` stands in for the trial's `jetctl up`)."""

from __future__ import annotations

import json
import subprocess
import time
from pathlib import Path

import pytest

from jetctl.research.report import render_markdown, trial_rows
from jetctl.research.runner import StudyRunner, _suggest, storage_url
from jetctl.research.study import load_study
from jetctl.research.trial import trial_cost

pytestmark = pytest.mark.unit

ROOT = Path(__file__).resolve().parents[2]

STUDY = """\
study: {{name: priced, recipe: {recipe}}}
hypothesis: {{statement: cheap trials do, metric_at_least: 0.5}}
metric: {{key: reward/mean, last_steps: 2}}
budget: {{trials: 3, trial_cpu_s: 100, study_cpu_s: 110}}
search: {{sampler: random, pruner: none}}
space:
  models.policy.optimizer.lr: {{type: log, low: 1.0e-4, high: 1.0e-2}}
"""


def step_row(step: int, server_cpu_s: float, client_cpu_s: float, usd: float) -> dict[str, object]:
    """A step row's reward and cost fields, as the trainer writes them."""
    return {
        "step": step, "stepped": 1, "reward/mean": 0.1 * step,
        "cost/server_cpu_s": server_cpu_s, "cost/train_cpu_s": server_cpu_s / 2,
        "cost/generate_cpu_s": server_cpu_s / 2, "cost/publish_cpu_s": 0.0,
        "cost/tokens_by_task": {"digits": [100, 80]},
        "cost/client_by_task": {"digits": {"client_cpu_s": client_cpu_s, "usd/api": usd}},
    }


def write_steps(run_dir: Path, rows: list[dict[str, object]]) -> None:
    (run_dir / "metrics").mkdir(parents=True, exist_ok=True)
    with (run_dir / "metrics" / "policy.steps.jsonl").open("a") as f:
        f.writelines(json.dumps(r) + "\n" for r in rows)


def test_trial_cost_sums_the_servers_and_clients_cpu_and_the_reported_spend(tmp_path: Path) -> None:
    write_steps(tmp_path, [step_row(1, 10.0, 4.0, 0.01), step_row(2, 12.0, 5.0, 0.02)])
    cpu, usd = trial_cost(tmp_path, ["policy", "absent"])
    assert cpu == pytest.approx(10 + 4 + 12 + 5) and usd == pytest.approx(0.03)


def test_a_trial_past_its_cpu_budget_is_stopped_and_the_study_stops_starting_trials(
    tmp_path: Path,
) -> None:
    file = tmp_path / "priced.yaml"
    file.write_text(STUDY.format(recipe=ROOT / "recipes" / "tiny.yaml"))
    study = load_study(file)
    study_dir = tmp_path / "priced"
    said: list[str] = []
    runner = StudyRunner(study, study_dir, parallel=1, say=said.append)
    trial = runner.optuna_ask()
    _suggest(trial, study)
    run_dir = study_dir / "trials" / "0000"
    run = runner._new_run(trial.number, run_dir)
    run.recipe.parent.mkdir(parents=True, exist_ok=True)
    run.proc = subprocess.Popen(["sleep", "120"])  # stands in for the trial's `jetctl up`
    runner.active[trial.number] = (trial, run)

    write_steps(run_dir, [step_row(1, 30.0, 10.0, 0.0), step_row(2, 30.0, 10.0, 0.0)])
    runner._poll(trial.number)
    assert run.stopping is None and runner._study_cost_left()  # 80 CPU s: under both budgets

    write_steps(run_dir, [step_row(3, 30.0, 10.0, 0.0)])
    runner._poll(trial.number)  # 120 CPU s > trial_cpu_s 100
    assert run.stopping is not None and run.stopping[0] == "budget"
    assert "trial_cpu_s (100) reached (120 CPU s)" in run.stopping[1]
    run.proc.terminate()  # what `jetctl down` makes a real `up` do
    deadline = time.monotonic() + 60
    while trial.number in runner.active and time.monotonic() < deadline:  # `jetctl down` ends
        time.sleep(0.2)
        if trial.number in runner.active:
            runner._poll(trial.number)
    assert trial.number not in runner.active

    frozen = runner.ostudy.trials[0]
    assert frozen.user_attrs["outcome"] == "budget"
    assert frozen.state.name == "COMPLETE" and frozen.value == pytest.approx(0.25)
    assert frozen.user_attrs["cost"] == [pytest.approx(120.0), pytest.approx(0.0)]
    assert runner._study_cost_left() is False  # 120 CPU s spent of study_cpu_s 110
    assert any("cost budget is spent (120 CPU s" in s for s in said)
    runner.run()  # starts nothing: the budget is spent, though 2 of 3 trials are left
    assert len(runner.ostudy.trials) == 1

    report = render_markdown(study, trial_rows(storage_url(study_dir), study.name))
    assert "| CPU s | USD |" in report and "| 120 | 0.0000 |" in report


def test_a_metric_from_the_newest_eval_of_a_task(tmp_path: Path) -> None:
    """metric: {task, eval}: the figure of the task's newest evaluated step, as `jetctl eval`
    and the in-run eval keep them (RUN_DIR/eval/step-S.<split>.json)."""
    from jetctl.research.study import Metric, StudyError
    from jetctl.research.trial import metric_value

    metric = Metric(task="digits", eval="pass_at_1")
    assert metric_value(tmp_path, metric) is None  # nothing evaluated yet
    (tmp_path / "eval").mkdir()
    for step, p in ((10, 0.2), (20, 0.45)):
        (tmp_path / "eval" / f"step-{step}.test.json").write_text(json.dumps({"digits": {
            "step": step, "pass_at_1": p, "pass_at_k": p, "mean_reward": p, "well_formed": 1.0,
            "tokens_per_answer": 5.0, "rows": 8, "samples": 1, "failed": 0}}))
    assert metric_value(tmp_path, metric) == pytest.approx(0.45)

    file = tmp_path / "evalmetric.yaml"
    file.write_text(STUDY.format(recipe=ROOT / "recipes" / "tiny.yaml").replace(
        "metric: {key: reward/mean, last_steps: 2}", "metric: {task: digits, eval: pass_at_1}"))
    with pytest.raises(StudyError, match="runs no in-run eval"):
        load_study(file)  # tiny.yaml's task has no eval: block
