"""Study files: the shipped studies load; planted mistakes are reported with line and fix."""

from __future__ import annotations

import math
from pathlib import Path

import pytest

from jetctl.research.study import StudyError, Watchdog, load_study
from jetctl.research.watchdog import StepLog, TrialWatchdog

pytestmark = pytest.mark.unit

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.parametrize("name", ["crash.yaml", "learning-rate.yaml"])
def test_shipped_studies_load(name: str) -> None:
    study = load_study(ROOT / "studies" / name)
    assert study.recipe_path.exists()
    assert "models.policy.optimizer.lr" in study.base_values()


BAD = """\
study:
  name: bad
  recipe: {recipe}
hypothesis:
  statement: x
metric:
  task: digit
budget:
  trials: 2
  max_step: 4
search:
  sampler: grid
space:
  models.policy.optimizer.lr:
    type: log
    low: 1.0e-4
    high: 1.0e-2
  tasks.digits.group_size:
    type: categorical
    choices: [8, 1]
  models.policy.optimiser.lr:
    type: float
    low: 0.1
    high: 0.2
"""


def test_planted_mistakes_are_all_reported_with_line_and_fix(tmp_path: Path) -> None:
    file = tmp_path / "bad.yaml"
    file.write_text(BAD.format(recipe=ROOT / "recipes" / "tiny.yaml"))
    with pytest.raises(StudyError) as err:
        load_study(file)
    text = err.value.render()
    # a typo in a budget key, with its line and a suggestion
    assert f"{file}:10: budget.max_step: unknown key; did you mean 'max_steps'?" in text
    # after the schema, the space against the recipe and the cross-field checks
    file.write_text(BAD.format(recipe=ROOT / "recipes" / "tiny.yaml").replace("max_step:", "max_steps:"))
    with pytest.raises(StudyError) as err:
        load_study(file)
    lines = err.value.render().splitlines()
    assert any(ln.startswith(f"{file}:7: metric.task = 'digit'") and "did you mean 'digits'" in ln
               for ln in lines), lines
    # group_size 1 is refused by the recipe itself, at the study's line of that field
    assert any(ln.startswith(f"{file}:18: space.tasks.digits.group_size = 1: the recipe refuses")
               for ln in lines), lines
    # a misspelt recipe path: the recipe's own "did you mean"
    assert any(ln.startswith(f"{file}:21: space.models.policy.optimiser.lr") and "optimizer" in ln
               for ln in lines), lines
    # a grid over a continuous range needs its values
    assert any(ln.startswith(f"{file}:14: space.models.policy.optimizer.lr:") and "grid: [...]" in ln
               for ln in lines), lines


def test_watchdog_verdicts(tmp_path: Path) -> None:
    dog = TrialWatchdog(Watchdog(stall_s=60, collapsed_steps=3, grad_norm_limit=100.0), start=0.0)
    assert dog.check_row({"step": 1, "loss": 0.1, "grad_norm": 1.0}, now=1.0) is None
    nan = dog.check_row({"step": 2, "loss": math.nan, "grad_norm": 1.0}, now=2.0)
    assert nan is not None and nan.kind == "diverged" and "loss = nan at step 2" in nan.reason
    big = dog.check_row({"step": 3, "loss": 0.1, "grad_norm": 1e6}, now=3.0)
    assert big is not None and big.kind == "diverged" and "grad_norm" in big.reason
    verdicts = [dog.check_row({"step": s, "signal/collapsed": 1.0}, now=4.0) for s in (4, 5, 6)]
    assert verdicts[:2] == [None, None] and verdicts[2] is not None
    assert verdicts[2].kind == "collapsed"
    assert dog.check_stall(now=50.0) is None
    stalled = dog.check_stall(now=70.0)
    assert stalled is not None and stalled.kind == "stalled"


def test_step_log_waits_for_a_whole_line(tmp_path: Path) -> None:
    path = tmp_path / "policy.steps.jsonl"
    log = StepLog(path)
    assert log.read_new() == []
    path.write_text('{"step": 1, "loss": 0.5}\n{"step": 2, "lo')
    assert [r["step"] for r in log.read_new()] == [1]
    with open(path, "a") as f:
        f.write('ss": 0.4}\n')
    assert [r["step"] for r in log.read_new()] == [2]
