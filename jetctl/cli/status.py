"""`jetctl status`: the live view of a run (models, tasks, clients), or one JSON document;
for a run that has finished, its summary (steps, final reward, ledger, curve, checkpoints).

    jetctl status                      # finds runs/latest; refreshes every 2 s; Ctrl-C quits
    jetctl status --once --json        # one JSON document for scripts (with the `ledger`)
    jetctl status --run-dir runs/x --interval 5
"""

from __future__ import annotations

import json
import time
from pathlib import Path
from typing import Annotated, Any

import typer
from rich.console import Console
from rich.live import Live

from jetctl.cli.errors import fail


def status(
    run_dir: Annotated[Path | None, typer.Option("--run-dir", help="Default: runs/latest.")] = None,
    once: Annotated[bool, typer.Option("--once", help="Print once and exit.")] = False,
    as_json: Annotated[bool, typer.Option("--json", help="JSON instead of tables.")] = False,
    interval: Annotated[float, typer.Option("--interval", help="Seconds between refreshes.")] = 2.0,
) -> None:
    """Show a run's models, tasks and clients, from its controller; a finished run's summary."""
    from jetctl.run.status import (
        RunFinished,
        document,
        fetch_status,
        finished_summary,
        render_status,
        render_summary,
    )
    from jetctl.rundir import RunDirError, find_run_dir

    console = Console()

    def document_with_ledger(rd: Path) -> dict[str, Any]:
        from jetctl.run.ledger import build_ledger

        doc = document(fetch_status(rd))
        doc["ledger"] = build_ledger(rd).summary()  # what the controller received
        return doc

    def show_finished(rd: Path) -> None:
        summary = finished_summary(rd)
        if as_json:
            typer.echo(json.dumps(summary, indent=2 if once else None))
        else:
            console.print(render_summary(summary))

    try:
        rd = find_run_dir(run_dir)
        doc = document_with_ledger(rd)
    except RunFinished:
        show_finished(rd)
        return
    except RunDirError as e:
        fail(str(e))
    if once:
        if as_json:
            typer.echo(json.dumps(doc, indent=2))
        else:
            console.print(render_status(doc))
        return
    try:
        if as_json:  # one JSON document per line, every interval
            while True:
                typer.echo(json.dumps(doc))
                time.sleep(interval)
                doc = document_with_ledger(rd)
        with Live(render_status(doc), console=console, refresh_per_second=4) as live:
            while True:
                time.sleep(interval)
                doc = document_with_ledger(rd)
                live.update(render_status(doc))
    except KeyboardInterrupt:
        return
    except RunFinished:
        show_finished(rd)
    except RunDirError as e:
        fail(str(e))


def register(app: typer.Typer) -> None:
    app.command("status")(status)
