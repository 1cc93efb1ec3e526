"""`jetctl eval RECIPE|RUN_DIR [--task T] [--checkpoint base,latest] [--split test]
[--samples K] [--max-rows N] [--json]`: held-out rows through the task's agent, env and
reward.

A thin entry point: the logic is in jetctl/run/eval.py.
"""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import TYPE_CHECKING, Annotated

import typer

from jetctl.cli.errors import fail

if TYPE_CHECKING:
    from jetctl.run.eval import TaskFigures


def _f(x: float, digits: int = 3) -> str:
    return "-" if math.isnan(x) else f"{x:.{digits}f}"


def register(app: typer.Typer) -> None:
    @app.command("eval")
    def eval_command(
        target: Annotated[Path, typer.Argument(help="A recipe file or a run dir.")],
        task: Annotated[list[str] | None, typer.Option("--task", help="A dataset task "
                                                       "(repeat; default: all of them).")] = None,
        checkpoint: Annotated[str, typer.Option("--checkpoint", help="base, latest, step-N, "
                                                "or two of them: base,latest.")] = "latest",
        split: Annotated[str, typer.Option("--split", help="The split to score.")] = "test",
        samples: Annotated[int, typer.Option("--samples", help="K: samples per row.")] = 4,
        max_rows: Annotated[int | None, typer.Option(
            "--max-rows", help="Score only the split's first N rows (default: all).")] = None,
        batch: Annotated[int, typer.Option("--batch", help="Rollouts generated together.")] = 64,
        seed: Annotated[int, typer.Option("--seed", help="Sampling seed.")] = 0,
        as_json: Annotated[bool, typer.Option("--json", help="One JSON object keyed by "
                                              "checkpoint.")] = False,
    ) -> None:
        """Score a model at one or two checkpoints on a task's held-out rows (no training)."""
        from rich.console import Console
        from rich.progress import BarColumn, MofNCompleteColumn, Progress, TimeElapsedColumn

        from jetctl.envs.dataset import DatasetError
        from jetctl.models import quiet_model_libraries
        from jetctl.run import eval as ev
        from jetctl.server.trained import TrainedError, open_source

        labels = [c.strip() for c in checkpoint.split(",") if c.strip()]
        if not 1 <= len(labels) <= 2:
            fail(f"--checkpoint {checkpoint!r}: give one checkpoint or two, e.g. base,latest")
        quiet_model_libraries()
        console = Console(stderr=True)
        try:
            source = open_source(target)
            with Progress("{task.description}", BarColumn(), MofNCompleteColumn(),
                          TimeElapsedColumn(), console=console, transient=True) as bar:
                bars: dict[str, object] = {}

                def progress(what: str, done: int, total: int) -> None:
                    if what not in bars:
                        bars[what] = bar.add_task(what, total=total)
                    bar.update(bars[what], completed=done)  # type: ignore[arg-type]

                report = ev.evaluate(source, labels, tasks=task, split=split, samples=samples,
                                     batch=batch, seed=seed, max_rows=max_rows,
                                     on_progress=progress)
        except (TrainedError, DatasetError) as exc:
            fail(str(exc))
        ev.save_results(source, report, split)
        if as_json:
            typer.echo(json.dumps(ev.as_json(report), indent=1))
            return
        _print(report, labels, samples)

    def _print(report: dict[str, dict[str, TaskFigures]], labels: list[str], k: int) -> None:
        from rich.console import Console
        from rich.table import Table

        from jetctl.run.eval import difference

        table = Table(title=f"eval ({k} samples per row)")
        for column in ("task", "checkpoint", "rows", "pass@1", f"pass@{k}", "mean reward",
                       "well-formed", "tokens/answer", "failed"):
            table.add_column(column)
        for name in report[labels[0]]:
            for label in labels:
                f = report[label][name]
                shown = f"{label} (step {f.step})" if label != "base" else "base"
                table.add_row(name, shown, str(f.rows), _f(f.pass_at_1), _f(f.pass_at_k),
                              _f(f.mean_reward), _f(f.well_formed), _f(f.tokens_per_answer, 1),
                              str(f.failed))
            if len(labels) == 2:
                a, b = report[labels[0]][name], report[labels[1]][name]
                d = difference(labels[0], a, labels[1], b)
                table.add_row(name, f"{labels[1]} - {labels[0]}", "",
                              f"{b.pass_at_1 - a.pass_at_1:+.3f}", f"{b.pass_at_k - a.pass_at_k:+.3f}",
                              f"{d.mean_reward:+.3f} ± {_f(d.ci95)} (95%)",
                              f"{b.well_formed - a.well_formed:+.3f}",
                              f"{b.tokens_per_answer - a.tokens_per_answer:+.1f}", "")
        console = Console()
        if not console.is_terminal:  # a pipe or a file: no wrapping at 80 columns
            console.width = 160
        console.print(table)
