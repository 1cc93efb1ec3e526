"""The cost ledger: a real trainer's step rows (builtin:tiny, a real store) summed into
per-model and per-task costs, and the line the run's summary shows."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
from rich.console import Console

from jetctl.costs import read_costs
from jetctl.rundir import write_json_atomic
from tests.server.trainer_support import config, make_trainer, step, submit

pytestmark = pytest.mark.unit


def test_a_runs_steps_add_up_to_its_costs_and_the_summary_shows_them(tmp_path: Path) -> None:
    trainer = make_trainer(tmp_path, config(finetune="lora"))
    # per step: a group of 3 x 3 completion tokens trained on; before the second step one
    # more group without signal (all rewards equal): generated, consumed, never trained
    submit(trainer, rewards=(0.0, 1.0, 0.5))
    assert step(trainer) is not None
    submit(trainer, rewards=(1.0, 1.0, 1.0))
    submit(trainer, rewards=(0.0, 2.0, 0.5))
    assert step(trainer) is None  # the group without signal consumed: nothing to train yet
    assert step(trainer) is not None
    rows = [json.loads(line) for line in trainer.steps_log.read_text().splitlines()]
    for row in rows:
        assert row["cost/server_cpu_s"] >= row["cost/train_cpu_s"] > 0
        assert row["cost/generate_cpu_s"] == pytest.approx(
            row["cost/server_cpu_s"] - row["cost/train_cpu_s"] - row["cost/publish_cpu_s"])
    assert [r["tokens/generated"] for r in rows] == [9.0, 18.0]
    assert [r["tokens/trained"] for r in rows] == [9.0, 9.0]

    costs = read_costs(trainer.steps_log)
    assert costs is not None and costs.steps == 2
    assert (costs.tokens_generated, costs.tokens_trained) == (27, 18)
    assert costs.server_cpu_s == pytest.approx(sum(r["cost/server_cpu_s"] for r in rows))
    assert costs.tasks["digits"].cpu_s == pytest.approx(costs.server_cpu_s)  # the only task

    # the finished run's summary: one cost line for the model
    from jetctl.status import finished_summary, render_summary

    rd = tmp_path / "run"
    recipe = tmp_path / "r.yaml"
    recipe.write_text("run: {name: t}\nmodels:\n  policy: {model: builtin:tiny}\n"
                      "tasks:\n  digits:\n    env: envs.digits:make_env\n"
                      "    agent: agents.digits:agent\n    model: policy\n")
    write_json_atomic(rd / "run.json", {"run": "t", "recipe": str(recipe), "state": "finished",
                                        "servers": {"policy": {}}})
    (rd / "metrics").mkdir()
    shutil.copy(trainer.steps_log, rd / "metrics" / "policy.steps.jsonl")
    summary = finished_summary(rd)
    assert summary["models"]["policy"]["costs"]["tokens_generated"] == 27
    console = Console(width=400, record=True)
    console.print(render_summary(summary))
    text = console.export_text()
    assert "cost policy: server CPU" in text and "tokens generated 27, trained 18" in text
