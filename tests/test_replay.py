"""`jetctl replay` and step bundles on a real trainer (builtin:tiny, LoRA, a real store and
real checkpoints): a replayed step is bitwise the recorded one; a changed stored token is not."""

from __future__ import annotations

import sqlite3
from pathlib import Path

import pytest

from jetctl.proto._gen import swarm_pb2
from jetctl.recipe import CheckpointConfig
from jetctl.replay import ReplayError, read_records, replay_bundle, replay_run_step, write_bundle
from jetctl.server.step import load_trainable
from jetctl.server.trainer import Trainer
from tests.server.trainer_support import config, make_trainer, step, submit

pytestmark = pytest.mark.unit


def _run(tmp_path: Path, steps: int, every_steps: int = 1000) -> Trainer:
    """A short real training run: one group per step, rewards that always carry signal."""
    cfg = config(finetune="lora", checkpoint=CheckpointConfig(every_steps=every_steps, keep=5))
    model, _ = load_trainable(cfg)  # the server's attention kernel, as replay loads it
    trainer = make_trainer(tmp_path, cfg, model=model)
    for i in range(steps):
        submit(trainer, rewards=(0.0, 1.0 + i, 0.5))
        assert step(trainer) is not None
    assert trainer.version == steps
    return trainer


def _replay(trainer: Trainer, tmp_path: Path, n: int):  # type: ignore[no-untyped-def]
    return replay_run_step(trainer.cfg, tmp_path / "store.sqlite", trainer.steps_log,
                           str(tmp_path / "checkpoints"), n)


def test_three_steps_replay_bitwise_and_a_changed_token_is_reported(tmp_path: Path) -> None:
    trainer = _run(tmp_path, steps=3)
    records = read_records(trainer.steps_log)
    assert sorted(records) == [1, 2, 3] and all(r.weights_sha256 for r in records.values())
    for n in (1, 2, 3):  # step 3 retrains 1 and 2 from the seeded start first
        c = _replay(trainer, tmp_path, n)
        assert c.identical, c.differences
        assert c.replayed.loss == records[n].loss

    # one completion token of step 2's group changed in the store
    gid = records[2].group_ids[0]
    db = sqlite3.connect(tmp_path / "store.sqlite")
    (payload,) = db.execute("SELECT payload FROM groups WHERE id=?", (gid,)).fetchone()
    pb = swarm_pb2.TrajectoryGroup.FromString(payload)
    pb.trajectories[1].calls[0].completion_ids[0] += 1
    db.execute("UPDATE groups SET payload=? WHERE id=?", (pb.SerializeToString(), gid))
    db.commit()
    db.close()
    changed = _replay(trainer, tmp_path, 2)
    assert not changed.identical
    assert any(d.startswith("loss:") for d in changed.differences)
    assert _replay(trainer, tmp_path, 1).identical  # the steps before it are untouched


def test_replay_starts_from_the_checkpoint_before_the_step(tmp_path: Path) -> None:
    trainer = _run(tmp_path, steps=5, every_steps=3)  # a checkpoint at 3; 1-3's data dropped
    assert _replay(trainer, tmp_path, 4).identical
    assert _replay(trainer, tmp_path, 5).identical  # checkpoint 3, step 4 retrained, then 5
    with pytest.raises(ReplayError, match="no longer holds"):
        _replay(trainer, tmp_path, 2)
    with pytest.raises(ReplayError, match="no recorded step 9"):
        _replay(trainer, tmp_path, 9)


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
    from jetctl.server.store import GroupCodec, TrajectoryStore

    (tmp_path / "recipe.yaml").write_text(RECIPE)
    cfg = load_recipe(tmp_path / "recipe.yaml").models["policy"]
    paths = RunPaths(tmp_path / "run")
    paths.make()
    (paths.run_json).write_text(json.dumps({"recipe": str(tmp_path / "recipe.yaml")}))
    paths.server_dir("policy").mkdir()
    store = TrajectoryStore(paths.store("policy"), decode=GroupCodec())
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
