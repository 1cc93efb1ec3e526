"""The reward curve of a run: `reward_curve.csv` and `reward_curve.png` in the run dir.

Reads `<run_dir>/metrics/<model>.steps.jsonl` (one JSON object per optimizer step, with
"step", "time", "reward/mean", ...) and writes, per model, the raw `reward/mean` and its
trailing moving average. The controller calls `write_reward_curve(run_dir)` every ~30 s and
when the run ends; it is also usable by hand:

    python -c "from jetctl.plot import write_reward_curve; write_reward_curve('runs/latest')"

Lines that are not complete JSON (a step being written) are skipped.
"""

from __future__ import annotations

import csv
import json
from dataclasses import dataclass
from pathlib import Path

from jetctl.rundir import RunPaths, replacing

REWARD_KEY = "reward/mean"
STEPS_SUFFIX = ".steps.jsonl"


@dataclass(frozen=True)
class RewardPoint:
    step: int
    time: float
    reward: float


def read_reward_points(path: Path) -> list[RewardPoint]:
    """The (step, time, reward/mean) of every complete step line that has a reward."""
    points: list[RewardPoint] = []
    with open(path) as f:
        for line in f:
            try:
                rec = json.loads(line)
            except ValueError:
                continue
            if not isinstance(rec, dict) or rec.get(REWARD_KEY) is None or "step" not in rec:
                continue
            points.append(
                RewardPoint(int(rec["step"]), float(rec.get("time", 0.0)), float(rec[REWARD_KEY]))
            )
    points.sort(key=lambda p: p.step)
    return points


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


def write_reward_curve(run_dir: Path | str, window: int = 10) -> tuple[Path, Path] | None:
    """Write reward_curve.csv and reward_curve.png; None when no model has a step yet."""
    run_dir = Path(run_dir)
    curves = {m: pts for m, pts in read_run_rewards(run_dir).items() if pts}
    if not curves:
        return None
    paths = RunPaths(run_dir)
    csv_path, png_path = paths.reward_curve_csv, paths.reward_curve_png
    _write_csv(csv_path, curves, window)
    _write_png(png_path, curves, window)
    return csv_path, png_path


def _write_csv(path: Path, curves: dict[str, list[RewardPoint]], window: int) -> None:
    with replacing(path) as tmp, open(tmp, "w", newline="") as f:
        w = csv.writer(f)
        w.writerow(["model", "step", "time", "reward_mean", f"reward_mean_ma{window}"])
        for model, pts in curves.items():
            avg = moving_average([p.reward for p in pts], window)
            for p, a in zip(pts, avg):
                w.writerow([model, p.step, f"{p.time:.3f}", f"{p.reward:.6g}", f"{a:.6g}"])


def _write_png(path: Path, curves: dict[str, list[RewardPoint]], window: int) -> None:
    # the object API with the Agg canvas: no pyplot global state, safe off the main thread
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    fig = Figure(figsize=(8, 4.5), dpi=100)
    FigureCanvasAgg(fig)
    ax = fig.add_subplot(1, 1, 1)
    for i, (model, pts) in enumerate(curves.items()):
        color = f"C{i % 10}"
        steps = [p.step for p in pts]
        rewards = [p.reward for p in pts]
        ax.plot(steps, rewards, color=color, alpha=0.3, linewidth=1, label=f"{model} (raw)")
        ax.plot(steps, moving_average(rewards, window), color=color, linewidth=2,
                label=f"{model} (mean of last {window})")
    ax.set_xlabel("optimizer step")
    ax.set_ylabel(REWARD_KEY)
    ax.set_title(f"reward: {path.parent.name}")
    ax.grid(True, alpha=0.3)
    ax.legend(loc="best", fontsize="small")
    fig.tight_layout()
    with replacing(path) as tmp:
        fig.savefig(tmp, format="png")
