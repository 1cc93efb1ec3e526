"""`jetctl eval` (jetctl/run/eval.py) on builtin:tiny: the held-out rows of each dataset task run
through the task's agent and reward with the model at each checkpoint.

The first task's reward reads only the row (`score` column), so every figure is known by
hand: 6 test rows (of 24, test_fraction 0.25), K = 2 samples; a row whose score is negative
makes the reward raise, which must count as failed and stay out of the figures. The second
task's reward is the reply's length, which shows that `latest` is the checkpoint's model
and not the base one (greedy decoding: the same model gives the same replies).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import torch
from typer.testing import CliRunner

from jetctl.cli.main import build_app
from jetctl.envs.dataset import make_env
from jetctl.recipe import load_recipe
from jetctl.run.eval import difference, evaluate
from jetctl.server import checkpoint
from jetctl.server.trained import build_model, open_source

pytestmark = pytest.mark.unit

RECIPE = """\
# jetctl up {path}
run: {{name: eval-test, dir: {run_dir}}}
models:
  policy: {{model: builtin:tiny, finetune: full}}
tasks:
  scored:
    env: jetctl.envs.dataset:make_env
    agent: jetctl.envs.dataset:chat_agent
    model: policy
    sampling: {{temperature: 0.0, max_tokens: 6}}
    env_args: {{path: {data}, test_fraction: 0.25, reward: "tests.run.test_eval:row_score"}}
  lengths:
    env: jetctl.envs.dataset:make_env
    agent: jetctl.envs.dataset:chat_agent
    model: policy
    sampling: {{temperature: 0.0, max_tokens: 6}}
    env_args: {{path: {data}, test_fraction: 0.25, reward: "tests.run.test_eval:reply_length"}}
"""
SCORES = [1.0, 0.0, 0.5, -1.0] * 6  # -1: the reward raises


def row_score(completion: str, row: dict[str, Any]) -> float:
    if row["score"] < 0:
        raise ValueError("no score for this row")
    return float(row["score"])


def reply_length(completion: str, row: dict[str, Any]) -> float:
    return float(len(completion))


def make_run(tmp_path: Path) -> Path:
    data = tmp_path / "rows.jsonl"
    data.write_text("".join(json.dumps({"prompt": f"reply with {i}", "score": s}) + "\n"
                            for i, s in enumerate(SCORES)))
    recipe = tmp_path / "recipe.yaml"
    run_dir = tmp_path / "run"
    recipe.write_text(RECIPE.format(path=recipe, run_dir=run_dir, data=data))
    cfg = load_recipe(recipe, env={}).models["policy"]
    model, _ = build_model(cfg)
    torch.manual_seed(3)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn_like(p) * 0.5)
    checkpoint.save(run_dir / "checkpoints" / "policy", model, torch.optim.AdamW(model.parameters()),
                    4, {"version": 4}, keep=2)
    (run_dir / "run.json").write_text(json.dumps({"recipe": str(recipe)}))
    return run_dir


def test_the_figures_of_the_held_out_rows(tmp_path: Path) -> None:
    run_dir = make_run(tmp_path)
    source = open_source(run_dir)
    held_out = make_env(**{**source.recipe.tasks["scored"].env_args, "split": "test"}).rows
    scores = [r["score"] for r in held_out]
    ok = [s for s in scores if s >= 0]
    report = evaluate(source, ["base", "latest"], split="test", samples=2)
    for label, step in (("base", 0), ("latest", 4)):
        f = report[label]["scored"]
        assert (f.rows, f.samples, f.step) == (len(ok), 2, step)
        assert f.failed == 2 * (len(scores) - len(ok))  # raised: failed, not zero
        assert f.mean_reward == pytest.approx(sum(ok) / len(ok))
        assert f.pass_at_1 == pytest.approx(sum(s == 1.0 for s in ok) / len(ok))
        assert f.pass_at_k == f.pass_at_1  # the reward ignores the reply
        assert 0 < f.tokens_per_answer <= 6
    base, latest = report["base"]["lengths"], report["latest"]["lengths"]
    assert base.mean_reward != latest.mean_reward, "latest must be the checkpoint's model"
    d = difference("base", base, "latest", latest)
    assert d.mean_reward == pytest.approx(latest.mean_reward - base.mean_reward)


def test_the_paired_interval_by_hand() -> None:
    from jetctl.run.eval import TaskFigures

    def figures(rewards: list[float]) -> TaskFigures:
        return TaskFigures(0, 0, sum(rewards) / 4, 0, 0, 4, 1, 0, 0, rewards)

    d = difference("a", figures([0.0, 0.0, 0.0, 0.0]), "b", figures([1.0, 0.0, 1.0, 0.0]))
    # d_i = 1, 0, 1, 0: mean 0.5, sample sd sqrt(1/3), half width 1.96 sqrt(1/3) / 2
    assert d.mean_reward == 0.5
    assert d.ci95 == pytest.approx(1.96 * (1 / 3) ** 0.5 / 2)


def test_the_cli_prints_json_keyed_by_checkpoint_and_a_side_by_side_table(tmp_path: Path) -> None:
    run_dir = make_run(tmp_path)
    app = build_app()
    result = CliRunner().invoke(app, ["eval", str(run_dir), "--task", "scored", "--checkpoint",
                                      "base,step-4", "--samples", "1", "--json"])
    assert result.exit_code == 0, result.output
    out = json.loads(result.stdout)
    assert set(out) == {"base", "step-4"}
    assert {"pass_at_1", "pass_at_k", "mean_reward", "well_formed", "tokens_per_answer"} <= set(
        out["step-4"]["scored"])
    table = CliRunner().invoke(app, ["eval", str(run_dir), "--task", "scored", "--checkpoint",
                                     "base,latest", "--samples", "1"], terminal_width=200)
    assert table.exit_code == 0, table.output
    assert "latest - base" in table.stdout and "(95%)" in table.stdout
    missing = CliRunner().invoke(app, ["eval", str(run_dir), "--checkpoint", "step-9"])
    assert missing.exit_code == 1 and "no complete checkpoint step-9" in missing.output


def test_sharing_the_prompts_common_prefix_gives_the_same_replies(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """One prefix forward repeated per row against whole left-padded prompts (greedy, a
    randomised builtin:tiny so the replies differ by row)."""
    import jetctl.run.eval as ev

    run_dir = make_run(tmp_path)
    source = open_source(run_dir)
    task = source.recipe.tasks["scored"]
    model, tokenizer = ev.load_at(source.recipe.models["policy"],
                                  ev.find_checkpoint(source, "policy", "latest"))
    runner = ev.Runner(model, tokenizer, task, seed=0)
    opening = [{"role": "system", "content": "reply with the digit please answer the question"},
               {"role": "user", "content": "what is 3"}, {"role": "assistant", "content": "3"}]
    prompts = [tokenizer.apply_chat_template(
        [*opening, {"role": "user", "content": q}], add_generation_prompt=True, tokenize=True,
        return_dict=True)["input_ids"] for q in ("what is 7", "reply with the number 12 please", "add 1")]
    assert len(ev._common_prefix(prompts)) >= ev.MIN_SHARED_PREFIX

    def replies() -> list[list[int]]:
        calls = [ev._Call(list(p), 8, 0.0, 1.0) for p in prompts]
        runner._generate(calls)
        return [c.completion_ids for c in calls]

    shared = replies()
    monkeypatch.setattr(ev, "MIN_SHARED_PREFIX", 10**9)  # whole prompts, padded
    whole = replies()
    assert shared == whole
    assert len({tuple(r) for r in whole}) > 1, "the rows' replies differ: the test can fail"


def test_max_rows_and_two_tasks_evaluated_apart_share_the_step_file(tmp_path: Path) -> None:
    """An in-run eval scores one task per process (`--task T --max-rows N`): the second
    task's figures join the first's in step-4.test.json, and status reads both."""
    from jetctl.run.eval import latest_results, save_results

    run_dir = make_run(tmp_path)
    source = open_source(run_dir)
    for task in ("scored", "lengths"):
        report = evaluate(source, ["latest"], tasks=[task], split="test", samples=1, max_rows=2)
        save_results(source, report, "test")
    held_out = make_env(**{**source.recipe.tasks["scored"].env_args, "split": "test"}).rows
    first_two = [r["score"] for r in held_out[:2]]
    stored = json.loads((run_dir / "eval" / "step-4.test.json").read_text())
    assert set(stored) == {"scored", "lengths"}
    assert stored["scored"]["rows"] == sum(s >= 0 for s in first_two)  # a raising row: failed
    assert stored["lengths"]["rows"] == 2
    shown = latest_results(run_dir)
    assert {t: (f["step"], f["split"]) for t, f in shown.items()} == {
        "scored": (4, "test"), "lengths": (4, "test")}
