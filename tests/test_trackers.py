"""Each tracker of `run.trackers` receives a real step row and a rollout sample, and each is
read back from what it wrote, through its own reader (jetctl.trackers)."""

from __future__ import annotations

import json
import struct
import sys
import time
from pathlib import Path
from typing import TYPE_CHECKING

import pytest

from jetctl.recipe import Recipe, RecipeError, load_recipe
from jetctl.server.algorithms.grpo import group_advantages
from jetctl.trackers import Trackers, TrackingPlan, mlflow_uri, sample_rollouts
from jetctl.types import LLMCall, Trajectory, TrajectoryGroup

if TYPE_CHECKING:
    from jetctl.server.trainer import Trainer

pytestmark = pytest.mark.unit

# a row as the trainer writes it (keys from a tiny run's metrics/policy.steps.jsonl)
ROW = {
    "loss": 0.031, "num_tokens": 64.0, "step": 3.0, "stepped": 1.0, "time": 1.7e9,
    "reward/mean": 0.625, "reward/std": 0.484, "reward/trained_mean": 0.625,
    "frac_reward_zero_std": 0.0, "groups": 2.0, "staleness/mean": 1.0,
}


def _recipe(tmp_path: Path, trackers: list[object]) -> Recipe:
    return Recipe.model_validate({
        "run": {"name": "exp", "token": "secret-token", "trackers": trackers},
        "models": {"policy": {"model": "builtin:tiny"}},
        "tasks": {"digits": {"env": "envs.digits:make_env", "agent": "agents.digits:agent",
                             "model": "policy", "group_size": 2}},
    })


def _groups() -> list[TrajectoryGroup]:
    def traj(i: int, reward: float) -> Trajectory:
        call = LLMCall("policy", [1, 2, 3], [4, 5], [-0.1, -0.2], model_version=2)
        return Trajectory(id=f"t{i}", group_id="g", task="digits", task_id="0", calls=[call],
                          reward=reward)
    return [TrajectoryGroup("g", "digits", "0", "policy", [traj(0, 1.0), traj(1, 0.0)])]


def _decode(ids: list[int]) -> str:
    return " ".join(f"w{i}" for i in ids)


def _open(tmp_path: Path, trackers: list[object]) -> Trackers:
    plan = TrackingPlan.from_recipe(_recipe(tmp_path, trackers))
    assert plan is not None
    # as a joined server gets it: through the controller's JoinReply.recipe_json
    plan = TrackingPlan.from_json(json.dumps(plan.config))
    assert plan is not None
    return Trackers.open(plan, model="policy", run_dir=tmp_path, decode=_decode)


def _send(tmp_path: Path, trackers: list[object]) -> Trackers:
    t = _open(tmp_path, trackers)
    t.log(ROW, _groups(), group_advantages)
    t.close()
    assert t.failures == 0
    return t


def test_the_sample_holds_text_reward_advantage_and_version() -> None:
    rows = sample_rollouts(_groups(), group_advantages, _decode, k=4)
    assert [(r.prompt, r.completion, r.reward, r.version) for r in rows] == [
        ("w1 w2 w3", "w4 w5", 1.0, 2), ("w1 w2 w3", "w4 w5", 0.0, 2)]
    assert rows[0].advantage > 0 > rows[1].advantage  # the better rollout is pushed up


def test_tensorboard_event_files_hold_the_row(tmp_path: Path) -> None:
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    _send(tmp_path, ["tensorboard"])
    acc = EventAccumulator(str(tmp_path / "trackers" / "tensorboard" / "exp-policy"))
    acc.Reload()
    assert [(e.step, e.value) for e in acc.Scalars("policy/reward/mean")] == [(3, 0.625)]
    assert set(acc.Tags()["scalars"]) == {f"policy/{k}" for k in ROW}


def test_mlflow_local_store_holds_row_recipe_and_table(tmp_path: Path) -> None:
    from mlflow import MlflowClient

    _send(tmp_path, [{"name": "mlflow", "project": "digits-exp"}])
    client = MlflowClient(tracking_uri=mlflow_uri(tmp_path / "trackers" / "mlflow"))
    exp = client.get_experiment_by_name("digits-exp")
    assert exp is not None
    (run,) = client.search_runs([exp.experiment_id])
    assert run.info.run_name == "exp-policy"
    hist = client.get_metric_history(run.info.run_id, "policy/reward/mean")
    assert [(m.step, m.value) for m in hist] == [(3, 0.625)]
    art = Path(client.download_artifacts(run.info.run_id, "", str(tmp_path / "dl")))
    recipe = json.loads((art / "recipe.json").read_text())
    assert recipe["models"]["policy"]["model"] == "builtin:tiny"
    assert "token" not in recipe["run"]  # the secret stays out of the tracker
    table = json.loads((art / "rollouts" / "step_000003.json").read_text())
    assert table["columns"] == ["prompt", "completion", "reward", "advantage", "version"]
    assert [row[2] for row in table["data"]] == [1.0, 0.0]


def _wandb_records(path: Path) -> list[bytes]:
    """The records of a W&B run file: LevelDB's log format (32 KiB blocks of chunks, each
    crc32 | length | type, FULL=1 FIRST=2 MIDDLE=3 LAST=4) after a 7-byte `:W&B` header."""
    data = path.read_bytes()
    assert data[:4] == b":W&B"
    records, part, pos, block = [], b"", 7, 32768
    while pos + 7 <= len(data):
        if block - pos % block < 7:  # the block's tail is padding
            pos += block - pos % block
            continue
        _crc, length, kind = struct.unpack("<IHB", data[pos:pos + 7])
        chunk, pos = data[pos + 7:pos + 7 + length], pos + 7 + length
        if kind == 0:
            break
        part = chunk if kind in (1, 2) else part + chunk
        if kind in (1, 4):
            records.append(part)
    return records


def test_wandb_offline_run_files_hold_the_row(tmp_path: Path) -> None:
    from wandb.proto import wandb_internal_pb2

    _send(tmp_path, [{"name": "wandb", "project": "digits", "mode": "offline"}])
    (run_dir,) = (tmp_path / "trackers" / "wandb" / "wandb").glob("offline-run-*")
    run_file = next(run_dir.glob("run-*.wandb"))
    records: list[wandb_internal_pb2.Record] = []
    deadline = time.monotonic() + 30  # wandb-core, its own process, writes the file's tail
    while not any(r.WhichOneof("record_type") == "exit" for r in records):
        assert time.monotonic() < deadline, "the run file never got its exit record"
        time.sleep(0.2)
        records = [wandb_internal_pb2.Record.FromString(d) for d in _wandb_records(run_file)]
    history, config = [], {}
    for rec in records:
        if rec.WhichOneof("record_type") == "history":
            history.append({i.key or "/".join(i.nested_key): i.value_json for i in rec.history.item})
        elif rec.WhichOneof("record_type") == "run":
            config.update({i.key: i.value_json for i in rec.run.config.update})
        elif rec.WhichOneof("record_type") == "config":
            config.update({i.key: i.value_json for i in rec.config.update})
    rows = [h for h in history if "policy/reward/mean" in h]
    assert len(rows) == 1, history
    row = rows[0]
    assert json.loads(row["policy/reward/mean"]) == 0.625
    assert json.loads(row["_step"]) == 3
    assert json.loads(config["run"])["name"] == "exp"
    assert "token" not in json.loads(config["run"])  # the secret stays out of the tracker
    (table,) = (run_dir / "files" / "media" / "table").rglob("*.table.json")
    rollouts = json.loads(table.read_text())
    assert rollouts["columns"] == ["prompt", "completion", "reward", "advantage", "version"]
    assert [r[2] for r in rollouts["data"]] == [1.0, 0.0]


def test_trackio_local_store_holds_the_row(tmp_path: Path) -> None:
    assert "trackio" not in sys.modules, "trackio reads TRACKIO_DIR once, at import"
    _send(tmp_path, [{"name": "trackio", "project": "digits", "dir": str(tmp_path / "tio")}])
    from trackio.sqlite_storage import SQLiteStorage

    logs = SQLiteStorage.get_logs("digits", "exp-policy")
    assert [(r["step"], r["policy/reward/mean"]) for r in logs] == [(3, 0.625)]
    assert list((tmp_path / "tio").glob("*.db"))  # in the folder the recipe named


def test_a_failing_tracker_is_counted_and_does_not_raise(tmp_path: Path) -> None:
    t = _open(tmp_path, ["tensorboard"])

    class Broken:
        def log(self, *_: object) -> None:
            raise OSError("disk full")

        def close(self) -> None:
            pass

    t.trackers["broken"] = Broken()
    t.log(ROW, _groups(), group_advantages)
    t.close()
    assert t.failures == 1  # the tensorboard one still wrote
    assert list((tmp_path / "trackers" / "tensorboard" / "exp-policy").glob("events.*"))


def test_recipe_refuses_mode_outside_wandb_and_a_missing_tracker(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
) -> None:
    import importlib.util

    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec",
                        lambda name, *a: None if name == "mlflow" else real(name, *a))
    text = ("run: {trackers: [tensorboard, {name: mlflow}, {name: trackio, mode: offline}]}\n"
            "models: {policy: {model: 'builtin:tiny'}}\ntasks: {}\n")
    (tmp_path / "r.yaml").write_text(text)
    with pytest.raises(RecipeError) as e:
        load_recipe(tmp_path / "r.yaml")
    rendered = e.value.render()
    assert "pip install 'jetctl[trackers]'" in rendered and "mlflow" in rendered
    assert "is a wandb option" in rendered


def test_a_real_trainers_cost_figures_reach_tensorboard(tmp_path: Path) -> None:
    """The cost ledger's scalars (jetctl/costs.py) of a real trainer's steps, read back from
    TensorBoard's event files: the server's CPU split, the tokens, and the spend and client
    figures its groups' trajectories carried (each trajectory: COSTS; 3 a group)."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    from jetctl.proto.convert import group_to_pb
    from tests.server.trainer_support import config, make_trainer, step

    costs = {"usd/judge": 0.25, "client_cpu_s": 0.5, "env_s": 0.125}  # exact in float32
    trainer = make_trainer(tmp_path, config(finetune="lora"))
    trainer.trackers = _open(tmp_path, ["tensorboard"])
    for rewards in ((0.0, 1.0, 0.5), (1.0, 0.0, 2.0)):
        g = _group_with_costs(trainer, rewards, costs)
        assert trainer.store.put(g, group_to_pb(g).SerializeToString()).result(5).outcome \
            == "accepted"
        assert step(trainer) is not None
    trainer.trackers.close()
    assert trainer.trackers.failures == 0
    rows = [json.loads(line) for line in trainer.steps_log.read_text().splitlines()]

    acc = EventAccumulator(str(tmp_path / "trackers" / "tensorboard" / "exp-policy"))
    acc.Reload()

    def read(tag: str) -> list[tuple[int, float]]:
        return [(e.step, e.value) for e in acc.Scalars(f"policy/{tag}")]

    assert read("cost/usd") == [(1, 0.75), (2, 0.75)]  # 3 trajectories x 0.25
    assert read("cost/usd/judge") == [(1, 0.75), (2, 0.75)]
    assert read("cost/client_cpu_s") == [(1, 1.5), (2, 1.5)]
    assert read("cost/env_s") == [(1, 0.375), (2, 0.375)]
    assert read("tokens/generated") == read("tokens/trained") == [(1, 9.0), (2, 9.0)]
    for key in ("cost/server_cpu_s", "cost/train_cpu_s", "cost/generate_cpu_s",
                "cost/publish_cpu_s"):  # the log's float64, as TensorBoard keeps it (float32)
        assert read(key) == [(int(r["step"]), pytest.approx(r[key], rel=1e-6)) for r in rows]


def _group_with_costs(trainer: Trainer, rewards: tuple[float, ...],
                      costs: dict[str, float]) -> TrajectoryGroup:
    from tests.factories import make_group
    from tests.server.trainer_support import PROMPT

    g = make_group(rewards=rewards, version=trainer.version, prompt=PROMPT,
                   completion=(21, 22, 23))
    for t in g.trajectories:
        t.costs = dict(costs)
    return g
