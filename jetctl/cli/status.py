"""`jetctl status`: the live view of a run (servers and clients), or one JSON document.

    jetctl status                      # finds runs/latest; refreshes every 2 s; Ctrl-C quits
    jetctl status --once --json        # one JSON document for scripts
    jetctl status --run-dir runs/x --interval 5
"""

from __future__ import annotations

import json
import time
from pathlib import Path
from typing import Annotated

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
    """Show a run's servers and clients, from its controller."""
    from jetctl.controller.rundir import RunDirError, find_run_dir
    from jetctl.status import RunFinished, document, fetch_status, render_status

    console = Console()
    try:
        rd = find_run_dir(run_dir)
        doc = document(fetch_status(rd))
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
                doc = document(fetch_status(rd))
        with Live(render_status(doc), console=console, refresh_per_second=4) as live:
            while True:
                time.sleep(interval)
                doc = document(fetch_status(rd))
                live.update(render_status(doc))
    except KeyboardInterrupt:
        return
    except RunFinished as e:
        console.print(str(e))
    except RunDirError as e:
        fail(str(e))


def register(app: typer.Typer) -> None:
    app.command("status")(status)
