"""`jetctl research` (experimental): run a study of trials, or show one.

    jetctl research studies/crash.yaml [--parallel K] [--dir D]   # run or resume; writes the report
    jetctl research status runs/research/crash [--watch]          # the trials as they stand

The logic lives in `jetctl.research`; this module parses flags and draws.
"""

from __future__ import annotations

import time
from pathlib import Path
from typing import Annotated

import typer
from rich.console import Console
from rich.table import Table

from jetctl.cli.errors import fail


def research(
    target: Annotated[str, typer.Argument(help="A study YAML, or `status` followed by a study dir.")],
    study_dir: Annotated[Path | None, typer.Argument(help="With `status`: the study dir.")] = None,
    parallel: Annotated[int | None, typer.Option("--parallel", min=1, help="Trials at once (default: the study's search.parallel).")] = None,
    dir_: Annotated[Path | None, typer.Option("--dir", help="The study dir (default: the study's study.dir or runs/research/<name>).")] = None,
    watch: Annotated[bool, typer.Option("--watch", help="With `status`: redraw every 2 s until Ctrl-C.")] = False,
) -> None:
    """Run a study (experimental): each trial a `jetctl up`, searched by Optuna, watched, reported."""
    if target == "status":
        if study_dir is None:
            fail("give the study dir: jetctl research status runs/research/NAME")
        _status(study_dir, watch)
        return
    if study_dir is not None:
        fail(f"unexpected argument {study_dir}: jetctl research STUDY.yaml [--parallel K]")
    _run(Path(target), parallel, dir_)


def _run(file: Path, parallel: int | None, dir_: Path | None) -> None:
    from jetctl.research.report import trial_rows, write_report
    from jetctl.research.runner import StudyRunner, storage_url
    from jetctl.research.study import StudyError, load_study

    try:
        study = load_study(file)
    except StudyError as err:
        fail(err.render())
    study_dir = (dir_ or study.default_dir()).resolve()
    console = Console()
    try:
        runner = StudyRunner(study, study_dir, parallel or study.spec.search.parallel,
                             say=lambda s: console.print(s, highlight=False, soft_wrap=True))
    except RuntimeError as err:  # optuna missing
        fail(str(err))
    console.print(f"study {study.name} (experimental) in {study_dir}; "
                  f"watch: jetctl research status {study_dir}")
    try:
        runner.run()
    except KeyboardInterrupt:
        raise typer.Exit(130) from None
    md, page = write_report(study, study_dir, trial_rows(storage_url(study_dir), study.name))
    console.print(md.read_text(), highlight=False, soft_wrap=True)
    console.print(f"report: {md} and {page}")


def _status(study_dir: Path, watch: bool) -> None:
    from jetctl.research.report import trial_rows
    from jetctl.research.runner import import_optuna, storage_url

    db = study_dir / "study.sqlite"
    if not db.exists():
        fail(f"no study in {study_dir} (no study.sqlite): run jetctl research STUDY.yaml first")
    try:
        optuna = import_optuna()
    except RuntimeError as err:
        fail(str(err))
    names = optuna.get_all_study_names(storage=storage_url(study_dir))
    console = Console()
    while True:
        for name in names:
            rows = trial_rows(storage_url(study_dir), name)
            table = Table(title=f"study {name} ({study_dir})")
            for col in ("trial", "state", "outcome", "params", "metric", "steps", "resumes", "last event"):
                table.add_column(col)
            for r in rows:
                metric = r.value if r.value is not None else r.metric
                table.add_row(str(r.number), r.state, r.outcome, ", ".join(
                    f"{k.rsplit('.', 1)[-1]}={v:.3g}" if isinstance(v, float) else f"{k}={v}"
                    for k, v in r.params.items()), "-" if metric is None else f"{metric:.3f}",
                    str(r.steps), str(r.resumes), r.events[-1] if r.events else "")
            console.print(table)
        if not watch:
            return
        time.sleep(2.0)
        console.clear()


def register(app: typer.Typer) -> None:
    app.command("research")(research)
