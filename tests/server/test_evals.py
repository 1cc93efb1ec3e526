"""In-run eval (jetctl/server/evals.py): a task's `eval: {every_steps: N}`.

A real run (`jetctl up --detach`: controller, a builtin:tiny server, a client node of the
built-in dataset env) whose task asks for an eval every 2 steps. Training rows are rewarded
by the reply's length (mod 3: groups carry signal, the server steps); the held-out file's
rows carry a `score` the reward returns whatever the reply, so the eval's figures are known
by hand: over the first 3 held-out rows (max_rows) the mean reward is (1 + 0 + 0.5) / 3
and pass@1 (reward 1) is 1/3. The server must leave them in RUN_DIR/eval/step-S.test.json
for a due step S, hand them to a later step row (`eval/rows/...` in steps.jsonl), and
`jetctl status` must show them, live and after `jetctl down`.

The runner with a stand-in child (a short script in place of `jetctl eval`): checkpoints that
come faster than evals skip to the newest, an eval past its timeout is killed and counted,
a stop kills the running one.

The validate refusals: an every_steps that is no multiple of checkpoint.every_steps, a
held-out split that the env does not have, a task that is not a dataset task, each with its
line, its value and the fix.
"""

from __future__ import annotations

import json
import sys
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import TYPE_CHECKING, Any

import pytest

from jetctl.recipe import EvalConfig, RecipeError, parse_recipe
from tests.runs import ROOT, detached_run, jetctl, step_rows

if TYPE_CHECKING:
    from jetctl.server.evals import InRunEval

# The run's env imports this module for `score` (its reward): the node's forkserver loads
# it once (env_args' module:attr, jetctl.client.prewarm), so keep it light: jetctl.server.evals
# (its checkpoint module: torch) is imported where it is used, not here.

TEST_SCORES = [1.0, 0.0, 0.5, 1.0, 1.0, 1.0]  # the eval reads the first 3 (max_rows)
EVAL_ROWS = 3

RECIPE = """\
# jetctl up {recipe}
run: {{name: in-run-eval, duration_s: 500}}
models:
  policy:
    model: builtin:tiny
    finetune: full
    optimizer: {{lr: 2.0e-3}}
    train: {{groups_per_step: 2, max_staleness: 4}}
    checkpoint: {{every_steps: 2, keep: 50}}  # every step evaluated stays to be loaded
tasks:
  rows:
    env: jetctl.envs.dataset:make_env
    agent: jetctl.envs.dataset:chat_agent
    model: policy
    clients: 1
    group_size: 4
    concurrency: 4
    sampling: {{max_tokens: 4}}
    env_args: {{path: {train}, test_path: {test}, reward: "tests.server.test_evals:score"}}
    eval: {{every_steps: 2, max_rows: {rows}, timeout_s: 240}}
"""


def score(completion: str, row: dict[str, Any]) -> float:
    """A held-out row's own score; a training row's reply length mod 3 (signal)."""
    if "score" in row:
        return float(row["score"])
    return float(len(completion) % 3) / 2


@pytest.mark.integration
@pytest.mark.timeout(600)
def test_a_run_evaluates_its_due_checkpoints_and_shows_the_figures(tmp_path: Path) -> None:
    train, test = tmp_path / "train.jsonl", tmp_path / "test.jsonl"
    train.write_text("".join(json.dumps({"prompt": f"reply with {i % 10}"}) + "\n"
                             for i in range(40)))
    test.write_text("".join(json.dumps({"prompt": f"say {i}", "score": s}) + "\n"
                            for i, s in enumerate(TEST_SCORES)))
    recipe = tmp_path / "r.yaml"
    recipe.write_text(RECIPE.format(recipe=recipe, train=train, test=test, rows=EVAL_ROWS))
    results: dict[str, Any] = {}
    logged: list[dict[str, Any]] = []
    live: dict[str, Any] = {}
    with detached_run(recipe, tmp_path / "run") as run_dir:
        deadline = time.monotonic() + 420
        while time.monotonic() < deadline and not (results and logged and live):
            time.sleep(1)
            files = sorted((run_dir / "eval").glob("step-*.test.json"))
            if files:
                results = {"file": files[0].name, **json.loads(files[0].read_text())["rows"]}
            logged = [r for r in step_rows(run_dir) if "eval/rows/step" in r]
            if results and not live:
                out = jetctl("status", "--once", "--json", "--run-dir", str(run_dir),
                             check=False)
                if out.returncode == 0:
                    live = json.loads(out.stdout)["tasks"].get("rows", {}).get("eval") or {}
    assert results, "no eval results under RUN_DIR/eval/ within 420 s"
    step = results["step"]
    assert step > 0 and step % 2 == 0 and results["file"] == f"step-{step}.test.json"
    expected = TEST_SCORES[:EVAL_ROWS]
    assert (results["rows"], results["samples"], results["failed"]) == (EVAL_ROWS, 1, 0)
    assert results["mean_reward"] == pytest.approx(sum(expected) / EVAL_ROWS)
    assert results["pass_at_1"] == pytest.approx(sum(s == 1.0 for s in expected) / EVAL_ROWS)

    assert logged, "no step row carries the eval's figures"
    row = logged[0]
    assert row["eval/rows/step"] % 2 == 0 and row["step"] >= row["eval/rows/step"]
    assert row["eval/rows/mean_reward"] == pytest.approx(sum(expected) / EVAL_ROWS)
    assert row["eval/rows/rows"] == EVAL_ROWS and row["eval/failures"] == 0

    assert live.get("split") == "test" and live.get("step", 0) >= step
    assert live["mean_reward"] == pytest.approx(sum(expected) / EVAL_ROWS)
    with ThreadPoolExecutor(2) as pool:  # the finished run's summary, as JSON and as text
        as_json = pool.submit(jetctl, "status", "--once", "--json", "--run-dir", str(run_dir))
        as_text = pool.submit(jetctl, "status", "--once", "--run-dir", str(run_dir))
        finished, text = json.loads(as_json.result().stdout), as_text.result().stdout
    shown = finished["evals"]["rows"]
    assert shown["step"] >= step and shown["rows"] == EVAL_ROWS
    assert f"eval rows: step {shown['step']} (test, {EVAL_ROWS} rows x 1)" in text


def stand_in(asked: Path, seconds: float) -> Callable[[Path, str, int, EvalConfig], list[str]]:
    """A child in place of `jetctl eval`: it notes the options the server would give `jetctl
    eval` (`eval_argv`), takes `seconds` and prints that step's figures (each one the step
    number: all it knows)."""
    from jetctl.server.evals import FIGURES, eval_argv

    def argv(run_dir: Path, task: str, step: int, cfg: EvalConfig) -> list[str]:
        options = " ".join(eval_argv(run_dir, task, step, cfg)[5:])  # from --task on
        figures = {k: step for k in FIGURES}
        script = (f"import json, time; open({str(asked)!r}, 'a').write({options!r} + '\\n'); "
                  f"time.sleep({seconds}); "
                  f"print(json.dumps({{'step-{step}': {{{task!r}: {figures!r}}}}}))")
        return [sys.executable, "-c", script]
    return argv


def wait_for(evals: InRunEval, key: str, timeout_s: float = 30.0) -> list[dict[str, float]]:
    """The step rows' eval figures, taken as the trainer does, until one holds `key`."""
    rows: list[dict[str, float]] = []
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline and not any(key in r for r in rows):
        time.sleep(0.05)
        row = evals.take_scalars()
        if row:
            rows.append(row)
    return rows


@pytest.mark.unit
def test_checkpoints_that_come_faster_than_evals_skip_to_the_newest(tmp_path: Path) -> None:
    from jetctl.server.evals import InRunEval

    asked = tmp_path / "asked"
    block = EvalConfig(every_steps=2, split="train", samples=3, max_rows=7)
    evals = InRunEval(tmp_path, {"rows": block}, 0, command=stand_in(asked, seconds=1.5))
    evals.start()
    try:
        evals.checkpointed(2)
        deadline = time.monotonic() + 10
        while not asked.exists() and time.monotonic() < deadline:  # step 2's eval runs
            time.sleep(0.05)
        for step in (3, 4, 6):  # 3 is not due; 4 is replaced by 6 before it starts
            evals.checkpointed(step)
        rows = wait_for(evals, "eval/rows/step")
        rows += wait_for(evals, "eval/rows/step") if len(rows) < 2 else []
    finally:
        evals.stop()
    assert asked.read_text().splitlines() == [  # one at a time, what the block says
        f"--task rows --checkpoint step-{s} --split train --samples 3 --json --max-rows 7"
        for s in (2, 6)]
    assert [r["eval/rows/step"] for r in rows] == [2.0, 6.0]
    assert rows[-1]["eval/rows/mean_reward"] == 6.0 and rows[-1]["eval/failures"] == 0.0
    assert rows[-1]["eval/rows/seconds"] >= 1.5


@pytest.mark.unit
def test_an_eval_past_its_timeout_is_killed_and_counted(tmp_path: Path) -> None:
    from jetctl.server.evals import InRunEval

    asked = tmp_path / "asked"
    evals = InRunEval(tmp_path, {"rows": EvalConfig(every_steps=2, timeout_s=0.5)}, 0,
                      command=stand_in(asked, seconds=60))
    assert_killed_at_timeout(evals)


def assert_killed_at_timeout(evals: InRunEval) -> None:
    """An eval whose child outlives its timeout (60 s, against 0.5) is killed at once and
    counted as a failure, with no figures of its own."""
    evals.start()
    t0 = time.monotonic()
    try:
        evals.checkpointed(2)
        rows = wait_for(evals, "eval/failures")
    finally:
        evals.stop()
    assert time.monotonic() - t0 < 20, "the child was not killed at its timeout"
    assert rows == [{"eval/failures": 1.0}]


@pytest.mark.unit
def test_stopping_kills_the_running_eval(tmp_path: Path) -> None:
    from jetctl.server.evals import InRunEval

    asked = tmp_path / "asked"
    evals = InRunEval(tmp_path, {"rows": EvalConfig(every_steps=2)}, 0,
                      command=stand_in(asked, seconds=60))
    evals.start()
    evals.checkpointed(2)
    deadline = time.monotonic() + 10
    while not asked.exists() and time.monotonic() < deadline:
        time.sleep(0.05)
    t0 = time.monotonic()
    evals.stop()
    assert time.monotonic() - t0 < 5, "stop waited for the eval instead of killing it"
    assert evals.take_scalars() == {}


GOOD = """\
models:
  policy:
    model: builtin:tiny
    checkpoint: {every_steps: 5}
tasks:
  rows:
    env: jetctl.envs.dataset:make_env
    agent: jetctl.envs.dataset:chat_agent
    model: policy
    env_args: {path: data.jsonl, test_fraction: 0.2}
    eval: {every_steps: 10, max_rows: 40}
"""


def issues_of(text: str) -> list[tuple[int | None, str]]:
    with pytest.raises(RecipeError) as caught:
        parse_recipe(text, file="r.yaml", env={})
    return [(i.line, i.render()) for i in caught.value.issues]


@pytest.mark.unit
def test_a_good_eval_block_loads_with_its_defaults() -> None:
    task = parse_recipe(GOOD, env={}).tasks["rows"]
    assert task.eval is not None
    assert (task.eval.every_steps, task.eval.split, task.eval.samples, task.eval.max_rows) == (
        10, "test", 1, 40)


@pytest.mark.unit
def test_every_steps_must_fall_on_a_checkpoint() -> None:
    (line, text), = issues_of(GOOD.replace("every_steps: 10", "every_steps: 7"))
    assert line == 11
    assert "tasks.rows.eval.every_steps = 7" in text
    assert "not a multiple of models.policy.checkpoint.every_steps (5)" in text
    assert "use 10" in text


@pytest.mark.unit
def test_the_test_split_needs_held_out_rows() -> None:
    (line, text), = issues_of(GOOD.replace(", test_fraction: 0.2", ""))
    assert line == 11
    assert "tasks.rows.eval.split = 'test'" in text
    assert "add env_args.test_fraction" in text and "or set split: train" in text
    # the train split needs none
    parse_recipe(GOOD.replace(", test_fraction: 0.2", "").replace(
        "max_rows: 40", "max_rows: 40, split: train"), env={})


@pytest.mark.unit
def test_only_a_dataset_task_can_be_evaluated() -> None:
    text = GOOD.replace("jetctl.envs.dataset:make_env", "envs.digits:make_env")
    (line, shown), = issues_of(text)
    assert line == 11
    assert "tasks.rows.eval = " in shown and "every_steps" in shown
    assert "needs a dataset task (env: jetctl.envs.dataset:make_env)" in shown
    assert "remove eval:" in shown


@pytest.mark.unit
def test_every_eval_problem_is_reported_at_once() -> None:
    text = GOOD.replace("every_steps: 10", "every_steps: 7").replace(
        ", test_fraction: 0.2", "").replace("model: builtin:tiny",
                                            "model: builtin:tiny\n    runtime: external")
    found = [t for _, t in issues_of(text)]
    assert len(found) == 3, found
    assert any("not a multiple" in t for t in found)
    assert any("needs held-out rows" in t for t in found)
    assert any("runtime: external does not have" in t for t in found)


@pytest.mark.unit
def test_the_checkpoint_an_eval_reads_is_not_pruned_until_the_eval_ends(tmp_path: Path) -> None:
    """Fast steps during one eval: `checkpoint.keep` leaves the checkpoint the eval's child
    reads, and prunes it at the first save after the eval ended."""
    import torch

    from jetctl.recipe import load_recipe
    from jetctl.server import checkpoint
    from jetctl.server.evals import InRunEval
    from jetctl.server.trained import build_model

    root = tmp_path / "checkpoints" / "policy"
    model, _ = build_model(load_recipe(ROOT / "recipes" / "tiny.yaml", env={}).models["policy"])
    optimizer = torch.optim.AdamW(model.parameters())

    def save(version: int) -> None:
        checkpoint.save(root, model, optimizer, version, {"version": version}, keep=1)

    asked = tmp_path / "asked"
    evals = InRunEval(tmp_path, {"rows": EvalConfig(every_steps=2)}, 0,
                      command=stand_in(asked, seconds=60))
    save(2)
    evals.start()
    try:
        evals.checkpointed(2)
        deadline = time.monotonic() + 10
        while not asked.exists() and time.monotonic() < deadline:  # step 2's child runs
            time.sleep(0.05)
        assert asked.exists()
        for version in (3, 4, 5):
            save(version)
        assert checkpoint.versions(root) == [2, 5]  # 3 and 4 pruned; 2 is read
    finally:
        evals.stop()
    save(6)
    assert checkpoint.versions(root) == [6]
