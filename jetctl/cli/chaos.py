"""`jetctl chaos`: train under injected faults, then check that nothing was lost.

    jetctl chaos recipes/tiny.yaml --duration 600
    jetctl chaos recipes/tiny.yaml --duration 180 --run-dir runs/chaos-1
    jetctl chaos recipes/tiny.yaml --duration 240 --faults 1   # one fault, then the ledger

Runs the recipe like `jetctl up` (a controller in this process) while it kills servers
(kill -9 mid-batch and mid-checkpoint) and clients (mid-rollout), blackholes and resets the
clients' links to the servers, and drops Submit replies after the commit. Then it heals,
drains, prints each fault with its recovery time and the ledger of every trajectory id.
Exit code 1 when anything was lost or trained twice. The logic is `jetctl.run.chaos`.
"""

from __future__ import annotations

import logging
import time
from pathlib import Path
from typing import Annotated

import typer
from rich.console import Console

from jetctl.cli.errors import fail


def chaos(
    recipe: Annotated[Path, typer.Argument(help="The recipe YAML.")],
    duration: Annotated[float, typer.Option("--duration", help="Seconds of faults before the quiesce.")] = 600.0,
    run_dir: Annotated[Path | None, typer.Option("--run-dir", help="Default: runs/<run.name>-chaos-<time>.")] = None,
    grace: Annotated[float, typer.Option("--grace", help="Seconds each drain phase may take.")] = 30.0,
    faults: Annotated[int | None, typer.Option(
        "--faults", min=1,
        help="Quiesce as soon as this many faults were injected (--duration still bounds the "
             "run). Default: faults until --duration is nearly spent.")] = None,
) -> None:
    """Train under faults (kill -9, partitions, lost acks); print the ledger; exit 1 if unbalanced."""
    from jetctl.cli.up import load_recipe_or_fail
    from jetctl.run.chaos import ChaosError, ChaosRun, run_schedule
    from jetctl.rundir import RunDirError

    if duration < 30:
        fail(f"--duration {duration:g} is too short for one fault: use at least 30")
    rec = load_recipe_or_fail(recipe)
    rd = run_dir or Path(rec.run_dir).parent / f"{rec.run.name}-chaos-{time.strftime('%Y%m%d-%H%M%S')}"
    console = Console()
    rd.mkdir(parents=True, exist_ok=True)
    handler = logging.FileHandler(rd / "chaos.log")
    handler.setFormatter(logging.Formatter("%(asctime)s %(levelname)s %(name)s: %(message)s"))
    root = logging.getLogger("jetctl")
    root.setLevel(logging.INFO)
    root.addHandler(handler)

    def say(msg: str) -> None:
        console.print(msg, highlight=False, soft_wrap=True)
        logging.getLogger("jetctl.run.chaos").info("%s", msg)

    run = ChaosRun(recipe, rd, grace_s=grace, say=say)
    try:
        records, ledger = run_schedule(run, duration, max_faults=faults)
    except (ChaosError, RunDirError) as e:
        fail(str(e))
    console.rule("faults")
    for r in records:
        console.print(r.line(), style=None if r.ok else "red", highlight=False, soft_wrap=True)
    console.rule("ledger")
    console.print(ledger.render(), style=None if ledger.balanced else "red", highlight=False,
                  soft_wrap=True)
    versions = {m: run.resumed_from(m) for m in rec.models}
    console.print(f"run dir {rd}; server starts resumed from versions {versions}", highlight=False)
    if not ledger.balanced:
        raise typer.Exit(1)


def register(app: typer.Typer) -> None:
    app.command("chaos")(chaos)
