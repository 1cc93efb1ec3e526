"""`jetctl up RECIPE --replay-from RUN_DIR` on a run dir laid out as `jetctl up` lays it out
(a real trainer, store and checkpoints on builtin:tiny with LoRA): two re-trains reach
bitwise the same weights after 10 steps, each step the recorded one; a run whose groups were
dropped is refused with the setting that keeps them."""

from __future__ import annotations

import json
import threading
from pathlib import Path

import pytest
from typer.testing import CliRunner

from jetctl.cli.main import build_app
from jetctl.recipe import load_recipe
from jetctl.run.replay import read_records
from jetctl.rundir import RunPaths
from jetctl.server.step import load_trainable
from jetctl.server.store import TrajectoryStore
from jetctl.server.trainer import Trainer
from tests.server.trainer_support import step, submit

pytestmark = pytest.mark.unit

RECIPE = """\
run:
  name: rerun
models:
  policy:
    model: builtin:tiny
    finetune: lora
    optimizer:
      lr: 1.0e-2
    train:
      groups_per_step: 1
      max_staleness: 1{max_steps}
    checkpoint:
      every_steps: 4
      keep: 2
      keep_trained_groups: {kept}
tasks:
  digits:
    env: envs.digits:make_env
    agent: agents.digits:agent
    model: policy
    clients: 1
    group_size: 3
"""


def _recorded_run(tmp_path: Path, kept: str, steps: int) -> tuple[Path, Path]:
    """(recipe, run dir) of a finished run of `steps` steps, trained as a server trains."""
    recipe = tmp_path / "recipe.yaml"
    recipe.write_text(RECIPE.format(kept=kept, max_steps=""))
    cfg = load_recipe(recipe).models["policy"]
    paths = RunPaths(tmp_path / "run")
    paths.make()
    paths.run_json.write_text(json.dumps({"recipe": str(recipe), "state": "finished"}))
    paths.server_dir("policy").mkdir()
    store = TrajectoryStore(paths.store("policy"))
    model, _ = load_trainable(cfg)
    trainer = Trainer(model, cfg, store, weights_lock=threading.Lock(),
                      checkpoint_dir=str(paths.checkpoints("policy")),
                      steps_log=paths.steps_log("policy"))
    store.open(trained_through_step=trainer.resume())
    for i in range(steps):
        submit(trainer, rewards=(0.0, 1.0 + i % 3, 0.5))
        assert step(trainer) is not None
    trainer.stop()  # the last checkpoint, as a server's end takes it
    store.close()
    return recipe, paths.root


def test_two_replays_from_a_run_reach_the_same_weights_after_10_steps(tmp_path: Path) -> None:
    _, run = _recorded_run(tmp_path, kept="all", steps=12)
    again = tmp_path / "again.yaml"  # the run's recipe, stopped after 10 steps
    again.write_text(RECIPE.format(kept="all", max_steps="\n      max_steps: 10"))
    cli = CliRunner()
    outs = [tmp_path / "first", tmp_path / "second"]
    for out in outs:
        done = cli.invoke(build_app(), ["up", str(again), "--replay-from", str(run),
                                        "--run-dir", str(out)])
        assert done.exit_code == 0, done.output
        assert "policy: 10 steps re-trained" in done.output, done.output
        assert "identical to the record at every step" in done.output, done.output

    recorded = read_records(RunPaths(run).steps_log("policy"))
    first, second = (read_records(RunPaths(o).steps_log("policy")) for o in outs)
    assert sorted(first) == sorted(second) == list(range(1, 11))
    for n in range(1, 11):  # each step the recorded one, in both re-trains
        assert first[n].weights_sha256 == second[n].weights_sha256 == recorded[n].weights_sha256
        assert first[n].loss == second[n].loss == recorded[n].loss
    weights = [(RunPaths(o).checkpoints("policy") / "step-00000010" / "weights.safetensors")
               .read_bytes() for o in outs]
    assert weights[0] == weights[1]
    assert json.loads(RunPaths(outs[0]).run_json.read_text())["replay_from"] == str(run.resolve())

    done = cli.invoke(build_app(), ["up", str(again), "--replay-from", str(run),
                                    "--run-dir", str(outs[0])])
    assert done.exit_code == 1 and "already holds a re-trained policy" in done.output


def test_a_run_whose_groups_were_dropped_is_refused_with_the_setting(tmp_path: Path) -> None:
    # keep_trained_groups 1: each checkpoint (4, 8, and 9 at the end) drops the groups
    # trained up to it, so nothing is left to re-train from
    recipe, run = _recorded_run(tmp_path, kept="1", steps=9)
    done = CliRunner().invoke(build_app(), ["up", str(recipe), "--replay-from", str(run),
                                            "--run-dir", str(tmp_path / "out")])
    assert done.exit_code == 1, done.output
    assert "no longer holds the groups of steps 1-9" in done.output, done.output
    assert "keep_trained_groups: all" in done.output, done.output
