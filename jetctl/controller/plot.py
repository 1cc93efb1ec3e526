"""The reward curves of a run, in the run dir.

`reward_curve.csv` / `.png`: per model, the raw `reward/mean` of every batch the trainer took
and its trailing moving average, from `<run_dir>/metrics/<model>.steps.jsonl` (one JSON
object per batch, with "step", "stepped", "time"; lines that are not complete JSON, a batch
being written, are skipped). The x axis is time (minutes since the run's first batch): a
batch that took no step (all its groups had zero reward variance) keeps the step number of
the batch before it, so step numbers repeat and cannot be the x axis. Steps are marked on a
second axis along the top, and batches without a step are drawn hollow.

`reward_by_task.csv` / `.png`: per task, the mean reward of each accepted group in the order
the server received them, and the trailing mean of the last 32 groups (what `jetctl status`
shows as a task's reward, `Status.reward_by_task`), from each server's store (read-only).
Groups are what a task's curve counts, not steps: one step may train groups of several tasks.

The controller calls `write_reward_curve(run_dir)` every ~30 s and when the run ends; it is
also usable by hand:

    python -c "from jetctl.controller.plot import write_reward_curve; write_reward_curve('runs/latest')"
"""

from __future__ import annotations

import csv
import json
import sqlite3
from dataclasses import dataclass
from pathlib import Path

from jetctl.rundir import RunPaths, replacing

REWARD_KEY = "reward/mean"
STEPS_SUFFIX = ".steps.jsonl"
TASK_WINDOW = 32  # groups: the window of Status.reward_by_task


@dataclass(frozen=True)
class RewardPoint:
    batch: int  # 0, 1, 2, ... in the order the trainer took them
    step: int  # optimizer steps done after this batch (the model version)
    stepped: bool  # this batch took an optimizer step
    time: float  # unix seconds when the batch was done
    reward: float


def read_reward_points(path: Path) -> list[RewardPoint]:
    """Every complete batch line that has a reward, in the order they were written."""
    points: list[RewardPoint] = []
    with open(path) as f:
        for line in f:
            try:
                rec = json.loads(line)
            except ValueError:
                continue
            if not isinstance(rec, dict) or rec.get(REWARD_KEY) is None or "step" not in rec:
                continue
            points.append(RewardPoint(
                batch=len(points), step=int(rec["step"]),
                stepped=bool(rec.get("stepped", 1)), time=float(rec.get("time", 0.0)),
                reward=float(rec[REWARD_KEY]),
            ))
    return points


def minutes(points: list[RewardPoint], start: float) -> list[float]:
    """The x of each point: minutes since `start` (the run's first batch)."""
    return [(p.time - start) / 60.0 for p in points]


def step_ticks(points: list[RewardPoint], start: float, most: int = 8) -> list[tuple[float, int]]:
    """(minutes, step) of up to `most` evenly spaced steps, where each was first reached."""
    firsts: list[tuple[float, int]] = []
    seen: set[int] = set()
    for x, p in zip(minutes(points, start), points):
        if p.stepped and p.step not in seen:
            seen.add(p.step)
            firsts.append((x, p.step))
    if len(firsts) <= most:
        return firsts
    stride = (len(firsts) - 1) / (most - 1)
    return [firsts[round(i * stride)] for i in range(most)]


def moving_average(values: list[float], window: int) -> list[float]:
    """Trailing mean over the last `window` values (fewer at the start)."""
    out: list[float] = []
    total = 0.0
    for i, v in enumerate(values):
        total += v
        if i >= window:
            total -= values[i - window]
        out.append(total / min(i + 1, window))
    return out


def read_run_rewards(run_dir: Path) -> dict[str, list[RewardPoint]]:
    """model -> its reward points, for every `metrics/<model>.steps.jsonl` of the run."""
    metrics = RunPaths(Path(run_dir)).metrics
    curves: dict[str, list[RewardPoint]] = {}
    for path in sorted(metrics.glob(f"*{STEPS_SUFFIX}")):
        curves[path.name[: -len(STEPS_SUFFIX)]] = read_reward_points(path)
    return curves


@dataclass(frozen=True)
class GroupPoint:
    time: float  # seconds since the model's first accepted group
    reward: float  # the group's mean trajectory reward


def read_task_rewards(run_dir: Path) -> dict[tuple[str, str], list[GroupPoint]]:
    """(model, task) -> its accepted groups in the order received, from the servers' stores."""
    out: dict[tuple[str, str], list[GroupPoint]] = {}
    for model, path in RunPaths(Path(run_dir)).stores().items():
        db = sqlite3.connect(f"file:{path}?mode=ro", uri=True, timeout=5)
        try:
            rows = db.execute(
                "SELECT task, received_at, reward_sum, n_traj FROM groups "
                "WHERE state != 'rejected' AND n_traj > 0 ORDER BY received_at, rowid"
            ).fetchall()
        except sqlite3.OperationalError:  # a store being created: no groups table yet
            rows = []
        finally:
            db.close()
        start = rows[0][1] if rows else 0.0
        for task, received_at, reward_sum, n_traj in rows:
            point = GroupPoint(float(received_at) - start, float(reward_sum) / int(n_traj))
            out.setdefault((model, str(task)), []).append(point)
    return out


def write_task_curve(run_dir: Path | str, window: int = TASK_WINDOW) -> tuple[Path, Path] | None:
    """Write reward_by_task.csv and reward_by_task.png; None when no group is stored yet."""
    paths = RunPaths(Path(run_dir))
    curves = read_task_rewards(paths.root)
    if not curves:
        return None
    csv_path, png_path = paths.reward_by_task_csv, paths.reward_by_task_png
    with replacing(csv_path) as tmp, open(tmp, "w", newline="") as f:
        w = csv.writer(f)
        w.writerow(["model", "task", "group", "time", "reward", f"reward_last{window}"])
        for (model, task), pts in curves.items():
            avg = moving_average([p.reward for p in pts], window)
            for i, (p, a) in enumerate(zip(pts, avg), start=1):
                w.writerow([model, task, i, f"{p.time:.3f}", f"{p.reward:.6g}", f"{a:.6g}"])
    series = {f"{task} ({model})": [(p.time / 60, p.reward) for p in pts]
              for (model, task), pts in curves.items()}  # fmt: skip
    _plot(png_path, series, window, "minutes since the first group", "group reward",
          f"reward by task: {paths.root.name}", "groups")  # fmt: skip
    return csv_path, png_path


def write_reward_curve(run_dir: Path | str, window: int = 10) -> tuple[Path, Path] | None:
    """Write reward_curve.csv and reward_curve.png (and the per-task curve,
    `write_task_curve`); None when no model has a step yet."""
    run_dir = Path(run_dir)
    write_task_curve(run_dir)
    curves = {m: pts for m, pts in read_run_rewards(run_dir).items() if pts}
    if not curves:
        return None
    paths = RunPaths(run_dir)
    csv_path, png_path = paths.reward_curve_csv, paths.reward_curve_png
    start = min(p.time for pts in curves.values() for p in pts)
    _write_csv(csv_path, curves, window, start)
    _write_png(png_path, curves, window, start)
    return csv_path, png_path


def _write_csv(
    path: Path, curves: dict[str, list[RewardPoint]], window: int, start: float
) -> None:
    with replacing(path) as tmp, open(tmp, "w", newline="") as f:
        w = csv.writer(f)
        w.writerow(["model", "batch", "step", "stepped", "time", "elapsed_s", "reward_mean",
                    f"reward_mean_ma{window}"])
        for model, pts in curves.items():
            avg = moving_average([p.reward for p in pts], window)
            for p, a in zip(pts, avg):
                w.writerow([model, p.batch, p.step, int(p.stepped), f"{p.time:.3f}",
                            f"{p.time - start:.3f}", f"{p.reward:.6g}", f"{a:.6g}"])


def _write_png(
    path: Path, curves: dict[str, list[RewardPoint]], window: int, start: float
) -> None:
    series = {model: list(zip(minutes(pts, start), (p.reward for p in pts)))
              for model, pts in curves.items()}  # fmt: skip
    idle = {model: [(x, p.reward) for x, p in zip(minutes(pts, start), pts) if not p.stepped]
            for model, pts in curves.items()}  # fmt: skip
    first = next(iter(curves))
    _plot(path, series, window, "minutes since the first batch", REWARD_KEY,
          f"reward: {path.parent.name}", "batches", hollow=idle,
          top_ticks=(f"optimizer step ({first})", step_ticks(curves[first], start)))


def _plot(
    path: Path,
    series: dict[str, list[tuple[float, float]]],
    window: int,
    xlabel: str,
    ylabel: str,
    title: str,
    unit: str,
    hollow: dict[str, list[tuple[float, float]]] | None = None,
    top_ticks: tuple[str, list[tuple[float, int]]] | None = None,
) -> None:
    """Raw and moving-average lines per series; `hollow` points drawn as open circles (batches
    without a step); `top_ticks` label a second x axis along the top (steps over time)."""
    # the object API with the Agg canvas: no pyplot global state, safe off the main thread
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    fig = Figure(figsize=(8, 4.5), dpi=100)
    FigureCanvasAgg(fig)
    ax = fig.add_subplot(1, 1, 1)
    for i, (name, pts) in enumerate(series.items()):
        color = f"C{i % 10}"
        xs = [x for x, _ in pts]
        ys = [y for _, y in pts]
        ax.plot(xs, ys, color=color, alpha=0.3, linewidth=1, label=f"{name} (raw)")
        marks = (hollow or {}).get(name)
        if marks:
            ax.scatter([x for x, _ in marks], [y for _, y in marks], facecolors="none",
                       edgecolors=color, s=16, label=f"{name}: batch without a step")
        ax.plot(xs, moving_average(ys, window), color=color, linewidth=2,
                label=f"{name} (mean of last {window} {unit})")
    if top_ticks is not None and top_ticks[1]:
        top = ax.twiny()
        top.set_xlim(ax.get_xlim())
        top.set_xticks([x for x, _ in top_ticks[1]], [str(v) for _, v in top_ticks[1]])
        top.set_xlabel(top_ticks[0])
    ax.set_xlabel(xlabel)
    ax.set_ylabel(ylabel)
    ax.set_title(title, loc="left")
    ax.grid(True, alpha=0.3)
    ax.legend(loc="best", fontsize="small")
    fig.tight_layout()
    with replacing(path) as tmp:
        fig.savefig(tmp, format="png")
