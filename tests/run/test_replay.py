"""`jetctl replay` and step bundles on a real trainer (builtin:tiny, LoRA, a real store and
real checkpoints): a replayed step is bitwise the recorded one, during the run and after it
ended (as far as `checkpoint.keep_trained_groups` kept its groups); a changed stored token is
not."""

from __future__ import annotations

import random
import sqlite3
from pathlib import Path

import pytest

from jetctl.proto._gen import swarm_pb2
from jetctl.recipe import CheckpointConfig, RecipeError, parse_recipe
from jetctl.run.replay import (
    ReplayError,
    read_records,
    replay_bundle,
    replay_run_step,
    write_bundle,
)
from jetctl.server.step import load_trainable
from jetctl.server.trainer import Trainer
from tests.server.trainer_support import config, make_trainer, step, submit

pytestmark = pytest.mark.unit


def _run(tmp_path: Path, steps: int, every_steps: int = 1000, keep: int = 5,
         keep_trained_groups: int | str | None = None) -> Trainer:
    """A short real training run: one group per step, rewards that always carry signal."""
    cfg = config(finetune="lora", checkpoint=CheckpointConfig(
        every_steps=every_steps, keep=keep, keep_trained_groups=keep_trained_groups))
    model, _ = load_trainable(cfg)  # the server's attention kernel, as replay loads it
    trainer = make_trainer(tmp_path, cfg, model=model)
    for i in range(steps):
        submit(trainer, rewards=(0.0, 1.0 + i, 0.5))
        assert step(trainer) is not None
    assert trainer.version == steps
    return trainer


def _end(trainer: Trainer) -> None:
    """The run ends as a server's does: its last checkpoint, then the store closed."""
    trainer.stop()
    trainer.store.close()


def _replay(trainer: Trainer, tmp_path: Path, n: int):  # type: ignore[no-untyped-def]
    return replay_run_step(trainer.cfg, tmp_path / "store.sqlite", trainer.steps_log,
                           str(tmp_path / "checkpoints"), n)


def _change_a_token(store: Path, group_id: str) -> None:
    """One completion token of a stored group changed, as a bad disk or a bad hand would."""
    db = sqlite3.connect(store)
    (payload,) = db.execute("SELECT payload FROM groups WHERE id=?", (group_id,)).fetchone()
    pb = swarm_pb2.TrajectoryGroup.FromString(payload)
    pb.trajectories[1].calls[0].completion_ids[0] += 1
    db.execute("UPDATE groups SET payload=? WHERE id=?", (pb.SerializeToString(), group_id))
    db.commit()
    db.close()


def test_a_finished_run_replays_steps_chosen_at_random_and_a_changed_token_is_reported(
    tmp_path: Path,
) -> None:
    # checkpoints at 2, 4, 6 and, as the run ends, 7: with keep_trained_groups: all no
    # checkpoint drops a group, so any step replays after the end
    trainer = _run(tmp_path, steps=7, every_steps=2, keep_trained_groups="all")
    _end(trainer)
    records = read_records(trainer.steps_log)
    assert sorted(records) == list(range(1, 8)) and all(r.weights_sha256 for r in records.values())
    seed = random.randrange(2**32)
    chosen = sorted(random.Random(seed).sample(sorted(records), 3))
    for n in chosen:  # each from the newest checkpoint before it, the steps between retrained
        c = _replay(trainer, tmp_path, n)
        assert c.identical, (seed, n, c.differences)
        assert c.replayed.loss == records[n].loss

    changed_step = chosen[1]
    _change_a_token(tmp_path / "store.sqlite", records[changed_step].group_ids[0])
    changed = _replay(trainer, tmp_path, changed_step)
    assert not changed.identical, (seed, changed_step)
    assert any(d.startswith("loss:") for d in changed.differences)
    assert _replay(trainer, tmp_path, chosen[0]).identical  # the steps before it are untouched


def test_by_default_the_steps_after_the_oldest_checkpoint_kept_replay(tmp_path: Path) -> None:
    # keep 2: checkpoints 2, 4, 6 and 7 at the end, 6 and 7 kept; the groups of steps up to 6
    # are dropped, those of 7 stay, and 7 replays from checkpoint 6 after the run
    trainer = _run(tmp_path, steps=7, every_steps=2, keep=2)
    _end(trainer)
    assert _replay(trainer, tmp_path, 7).identical
    with pytest.raises(ReplayError, match="Steps that replay from this run dir: 7. .*"
                       "keep_trained_groups: all"):
        _replay(trainer, tmp_path, 6)


def test_replay_starts_from_the_checkpoint_before_the_step(tmp_path: Path) -> None:
    # a checkpoint at 3; with keep_trained_groups 1, 1-3's groups dropped at it
    trainer = _run(tmp_path, steps=5, every_steps=3, keep_trained_groups=1)
    assert _replay(trainer, tmp_path, 4).identical
    assert _replay(trainer, tmp_path, 5).identical  # checkpoint 3, step 4 retrained, then 5
    with pytest.raises(ReplayError, match="seeded start, through steps 1-2, and the store no "
                       "longer holds the groups of steps 1-2: .* Steps that replay from this "
                       "run dir: 4-5"):
        _replay(trainer, tmp_path, 2)
    with pytest.raises(ReplayError, match="no recorded step 9"):
        _replay(trainer, tmp_path, 9)


def test_keeping_groups_beyond_the_checkpoints_kept_is_refused() -> None:
    bad = RECIPE.replace("      max_staleness: 1\n", "      max_staleness: 1\n    checkpoint:\n"
                         "      keep: 2\n      keep_trained_groups: 3\n")
    with pytest.raises(RecipeError) as caught:
        parse_recipe(bad, file="r.yaml", env={})
    text = caught.value.render()
    assert "r.yaml:14: models.policy.checkpoint.keep_trained_groups = 3:" in text, text
    assert "is more than keep (2)" in text and "or use all" in text, text


def test_a_bundle_replays_without_the_run(tmp_path: Path) -> None:
    run = tmp_path / "run"
    trainer = _run(run, steps=3)
    out = write_bundle(trainer.cfg, "policy", run / "store.sqlite", trainer.steps_log,
                       str(run / "checkpoints"), 3, tmp_path / "step-3.tar")
    moved = tmp_path / "elsewhere" / "step-3.tar"
    moved.parent.mkdir()
    out.rename(moved)
    for p in sorted(run.rglob("*"), reverse=True):  # the run is gone: only the bundle is left
        p.unlink() if p.is_file() else p.rmdir()
    c = replay_bundle(moved)
    assert c.identical, c.differences
    assert c.recorded.step == 3


RECIPE = """\
run:
  name: replayed
models:
  policy:
    model: builtin:tiny
    finetune: lora
    optimizer:
      lr: 1.0e-2
    train:
      groups_per_step: 1
      max_staleness: 1
tasks:
  digits:
    env: envs.digits:make_env
    agent: agents.digits:agent
    model: policy
    clients: 1
    group_size: 3
"""


def test_the_cli_replays_a_run_dir_and_a_bundle(tmp_path: Path) -> None:
    """`jetctl replay` / `jetctl bundle` on a run dir laid out as `jetctl up` lays it out."""
    import json
    import threading

    from typer.testing import CliRunner

    from jetctl.cli.main import build_app
    from jetctl.recipe import load_recipe
    from jetctl.rundir import RunPaths
    from jetctl.server.store import TrajectoryStore

    (tmp_path / "recipe.yaml").write_text(RECIPE)
    cfg = load_recipe(tmp_path / "recipe.yaml").models["policy"]
    paths = RunPaths(tmp_path / "run")
    paths.make()
    (paths.run_json).write_text(json.dumps({"recipe": str(tmp_path / "recipe.yaml")}))
    paths.server_dir("policy").mkdir()
    store = TrajectoryStore(paths.store("policy"))
    model, _ = load_trainable(cfg)
    trainer = Trainer(model, cfg, store, weights_lock=threading.Lock(),
                      checkpoint_dir=str(paths.checkpoints("policy")),
                      steps_log=paths.steps_log("policy"))
    store.open(trained_through_step=trainer.resume())
    for i in range(2):
        submit(trainer, rewards=(0.0, 1.0 + i, 0.5))
        assert step(trainer) is not None

    cli = CliRunner()
    done = cli.invoke(build_app(), ["replay", str(paths.root), "--step", "2"])
    assert done.exit_code == 0, done.output
    assert done.output.startswith("identical: step 2")
    tar = tmp_path / "step-2.tar"
    done = cli.invoke(build_app(), ["bundle", str(paths.root), "--step", "2", "--out", str(tar)])
    assert done.exit_code == 0, done.output
    done = cli.invoke(build_app(), ["replay", str(tar)])
    assert done.exit_code == 0 and done.output.startswith("identical: step 2"), done.output
    done = cli.invoke(build_app(), ["replay", str(paths.root), "--step", "7"])
    assert done.exit_code == 1 and "no recorded step 7" in done.output, done.output
