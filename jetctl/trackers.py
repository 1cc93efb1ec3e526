"""Experiment trackers (`run.trackers`): each server sends its step rows there.

    plan = TrackingPlan.from_recipe(recipe)       # None: the recipe names no tracker
    trackers = Trackers.open(plan, model="policy", run_dir=Path("runs/tiny"), decode=tok.decode)
    trackers.log(row, groups, advantages)   # after the row is in metrics/<model>.steps.jsonl
    trackers.close()                        # flushes; at the server's exit

What each tracker gets, from every step row of one model's server:
* every scalar of the row under the name the step log uses, prefixed by the model
  (`policy/reward/mean`; per-task keys keep their task in the name), at step = the row's
  `step` (the model version); among them the cost ledger's (jetctl/costs.py): the server's
  CPU seconds `cost/server_cpu_s` split into `cost/train_cpu_s`, `cost/generate_cpu_s` and
  `cost/publish_cpu_s`, the spend the envs reported `cost/usd` (and `cost/usd/<kind>`),
  `cost/client_cpu_s`, `cost/env_s`, and `tokens/generated`, `tokens/trained`;
* the run's recipe as the run's config (the token left out);
* a sample of the step's rollouts (prompt, completion, reward, advantage, version) as a
  table where the tracker has tables (W&B, MLflow, trackio); TensorBoard gets it as a
  markdown table in its text tab.

One small class per tracker behind `Tracker`; each imports its library when opened, so the
recipe and this module import nothing heavy. The trainer's thread only enqueues: a worker
thread sends, so a slow or failing tracker never holds up a step. A failure is logged and
counted (`Trackers.failures`, the step row's `trackers/failures`), never raised.

Left out: one tracker run for all models (each server process has its own run, named
`<run.name>-<model>`), and media (images, histograms).
"""

from __future__ import annotations

import json
import logging
import os
import queue
import threading
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any, Protocol

from jetctl.recipe import Recipe, TrackerConfig
from jetctl.types import TrajectoryGroup

log = logging.getLogger(__name__)

SAMPLE_ROLLOUTS = 4  # rollouts per step in the table: enough to read, small to send
COLUMNS = ("prompt", "completion", "reward", "advantage", "version")


@dataclass(frozen=True)
class RolloutRow:
    """One sampled rollout of a step, as the tracker's table shows it."""

    prompt: str
    completion: str
    reward: float
    advantage: float
    version: int  # the oldest model version among its calls


@dataclass(frozen=True)
class TrackingPlan:
    """What a server needs of the recipe to track: `run.trackers`, `run.name`, and the
    recipe itself (the token left out) as the runs' config."""

    trackers: list[TrackerConfig]
    run_name: str
    config: dict[str, Any]

    @classmethod
    def from_recipe(cls, recipe: Recipe) -> TrackingPlan | None:
        """None when the recipe names no tracker."""
        if not recipe.run.trackers:
            return None
        config = recipe.model_dump(mode="json", exclude={"run": {"token"}})
        return cls(list(recipe.run.trackers), recipe.run.name, config)

    @classmethod
    def from_json(cls, recipe_json: str) -> TrackingPlan | None:
        """From the recipe the controller sends a joining server (`JoinReply.recipe_json`);
        each tracker is validated here too, so a host without it says so."""
        if not recipe_json:
            return None
        config = json.loads(recipe_json)
        run = config["run"]
        if not run["trackers"]:
            return None
        return cls([TrackerConfig.model_validate(t) for t in run["trackers"]], run["name"],
                   config)


@dataclass(frozen=True)
class RunInfo:
    """What names a tracker run: its project, its run name, where it writes, its config."""

    project: str
    name: str  # <run.name>-<model>
    model: str
    dir: Path
    config: dict[str, Any]


class Tracker(Protocol):
    def log(self, step: int, scalars: dict[str, float], rollouts: list[RolloutRow]) -> None: ...

    def close(self) -> None: ...


def sample_rollouts(
    groups: Sequence[TrajectoryGroup],
    advantages: Callable[[Sequence[float]], list[float]],
    decode: Callable[[list[int]], str],
    k: int = SAMPLE_ROLLOUTS,
) -> list[RolloutRow]:
    """The first `k` rollouts of the step's groups: the first call's prompt, every call's
    completion joined, and the advantage the algorithm gave each within its group."""
    rows: list[RolloutRow] = []
    for g in groups:
        advs = advantages([t.reward for t in g.trajectories])
        for t, adv in zip(g.trajectories, advs):
            if len(rows) == k:
                return rows
            prompt = decode(t.calls[0].prompt_ids) if t.calls else ""
            completion = "".join(decode(c.completion_ids) for c in t.calls)
            rows.append(RolloutRow(prompt, completion, t.reward, float(adv), t.min_version))
    return rows


def _named(model: str, scalars: dict[str, float]) -> dict[str, float]:
    return {f"{model}/{k}": float(v) for k, v in scalars.items()}


class TensorBoardTracker:
    def __init__(self, info: RunInfo) -> None:
        from torch.utils.tensorboard import SummaryWriter  # needs the tensorboard package

        self.model = info.model
        self.writer = SummaryWriter(log_dir=str(info.dir / info.name))
        self.writer.add_text("recipe", _markdown_json(info.config), 0)

    def log(self, step: int, scalars: dict[str, float], rollouts: list[RolloutRow]) -> None:
        for tag, value in _named(self.model, scalars).items():
            self.writer.add_scalar(tag, value, step)
        if rollouts:
            self.writer.add_text(f"{self.model}/rollouts", _markdown_table(rollouts), step)
        self.writer.flush()

    def close(self) -> None:
        self.writer.close()


class WandbTracker:
    def __init__(self, info: RunInfo, mode: str) -> None:
        import wandb

        info.dir.mkdir(parents=True, exist_ok=True)
        self.wandb = wandb
        self.model = info.model
        self.run = wandb.init(
            project=info.project, name=info.name, dir=str(info.dir), mode=mode,  # type: ignore[arg-type]
            config=info.config, reinit="create_new",
        )

    def log(self, step: int, scalars: dict[str, float], rollouts: list[RolloutRow]) -> None:
        data: dict[str, Any] = dict(_named(self.model, scalars))
        if rollouts:
            data[f"{self.model}/rollouts"] = self.wandb.Table(
                columns=list(COLUMNS), data=[list(asdict(r).values()) for r in rollouts]
            )
        self.run.log(data, step=step)

    def close(self) -> None:
        self.run.finish()


class MlflowTracker:
    def __init__(self, info: RunInfo) -> None:
        from mlflow import MlflowClient

        info.dir.mkdir(parents=True, exist_ok=True)
        self.model = info.model
        # MLflow 3 keeps its plain-folder store in maintenance mode: a sqlite file there
        self.client = MlflowClient(tracking_uri=mlflow_uri(info.dir))
        exp = self.client.get_experiment_by_name(info.project)
        exp_id = exp.experiment_id if exp else self.client.create_experiment(
            info.project, artifact_location=(info.dir.resolve() / "artifacts").as_uri()
        )
        self.run_id = self.client.create_run(exp_id, run_name=info.name).info.run_id
        self.client.log_dict(self.run_id, info.config, "recipe.json")

    def log(self, step: int, scalars: dict[str, float], rollouts: list[RolloutRow]) -> None:
        import time

        from mlflow.entities import Metric

        now = int(time.time() * 1000)
        metrics = [Metric(k, v, now, step) for k, v in _named(self.model, scalars).items()]
        self.client.log_batch(self.run_id, metrics=metrics)
        if rollouts:
            columns = {c: [getattr(r, c) for r in rollouts] for c in COLUMNS}
            self.client.log_table(
                self.run_id, data=columns, artifact_file=f"rollouts/step_{step:06d}.json"
            )

    def close(self) -> None:
        self.client.set_terminated(self.run_id)


def mlflow_uri(folder: Path) -> str:
    """The tracking URI of the MLflow store in `folder` (`mlflow ui --backend-store-uri` it)."""
    return f"sqlite:///{folder.resolve() / 'mlflow.db'}"


class TrackioTracker:
    def __init__(self, info: RunInfo, own_dir: bool) -> None:
        if own_dir:  # trackio reads its store's folder once, at import
            os.environ["TRACKIO_DIR"] = str(info.dir)
        import trackio

        self.trackio = trackio
        self.model = info.model
        self.run = trackio.init(
            project=info.project, name=info.name, config=info.config, embed=False,
            auto_log_gpu=False, auto_log_cpu=False,
        )

    def log(self, step: int, scalars: dict[str, float], rollouts: list[RolloutRow]) -> None:
        data: dict[str, Any] = dict(_named(self.model, scalars))
        if rollouts:
            data[f"{self.model}/rollouts"] = self.trackio.Table(
                columns=list(COLUMNS), data=[list(asdict(r).values()) for r in rollouts]
            )
        self.run.log(data, step=step)

    def close(self) -> None:
        self.run.finish()


def open_tracker(cfg: TrackerConfig, info: RunInfo) -> Tracker:
    if cfg.name == "tensorboard":
        return TensorBoardTracker(info)
    if cfg.name == "wandb":
        return WandbTracker(info, cfg.mode or "online")
    if cfg.name == "mlflow":
        return MlflowTracker(info)
    return TrackioTracker(info, own_dir=cfg.dir is not None)


class Trackers:
    """The run's trackers for one model's server: a queue and a worker thread in front."""

    def __init__(self, trackers: dict[str, Tracker], decode: Callable[[list[int]], str]) -> None:
        self.trackers = trackers
        self.decode = decode
        self.failures = 0  # tracker calls that raised (each logged)
        self._queue: queue.Queue[tuple[int, dict[str, float], list[RolloutRow]] | None] = (
            queue.Queue(maxsize=1000)
        )
        self._worker = threading.Thread(target=self._send, name="trackers", daemon=True)
        self._worker.start()

    @classmethod
    def open(
        cls, plan: TrackingPlan, *, model: str, run_dir: Path,
        decode: Callable[[list[int]], str],
    ) -> Trackers:
        """The plan's trackers for `model`; one that fails to open is logged and counted, and
        the others still run."""
        opened: dict[str, Tracker] = {}
        failures = 0
        for cfg in plan.trackers:
            info = RunInfo(
                project=cfg.project or plan.run_name, name=f"{plan.run_name}-{model}",
                model=model, config=plan.config,
                dir=Path(cfg.dir) if cfg.dir else run_dir / "trackers" / cfg.name,
            )
            try:
                opened[cfg.name] = open_tracker(cfg, info)
            except Exception:  # a tracker must never stop training: logged and counted
                failures += 1
                log.exception("tracker %s did not open; the run goes on without it", cfg.name)
        trackers = cls(opened, decode)
        trackers.failures = failures
        return trackers

    def log(
        self, scalars: dict[str, float], groups: Sequence[TrajectoryGroup],
        advantages: Callable[[Sequence[float]], list[float]],
    ) -> None:
        """Queue one step row and its rollout sample (dropped, and counted, when the queue
        is full: a tracker that stalls must not grow the server's memory)."""
        rows = sample_rollouts(groups, advantages, self.decode)
        try:
            self._queue.put_nowait((int(scalars.get("step", 0)), dict(scalars), rows))
        except queue.Full:
            self.failures += 1
            log.warning("trackers fall behind: step %s not sent", scalars.get("step"))

    def _send(self) -> None:
        while (item := self._queue.get()) is not None:
            step, scalars, rows = item
            for name, tracker in self.trackers.items():
                try:
                    tracker.log(step, scalars, rows)
                except Exception:  # never stops training: logged and counted
                    self.failures += 1
                    log.exception("tracker %s failed at step %d", name, step)

    def close(self, timeout_s: float = 60.0) -> None:
        """Send what is queued, then close each tracker (flushes its files)."""
        self._queue.put(None)
        self._worker.join(timeout_s)
        for name, tracker in self.trackers.items():
            try:
                tracker.close()
            except Exception:  # at exit: logged and counted, the others still close
                self.failures += 1
                log.exception("tracker %s failed to close", name)


def _markdown_table(rows: list[RolloutRow]) -> str:
    def cell(v: object) -> str:
        return str(v).replace("|", "\\|").replace("\n", " ")

    lines = ["| " + " | ".join(COLUMNS) + " |", "|" + "---|" * len(COLUMNS)]
    lines += ["| " + " | ".join(cell(v) for v in asdict(r).values()) + " |" for r in rows]
    return "\n".join(lines)


def _markdown_json(config: dict[str, Any]) -> str:
    return "```\n" + json.dumps(config, indent=2) + "\n```"
