"""`jetctl logs`: every process's structured log lines of a run, merged in time order.

    jetctl logs                          # runs/latest: controller, servers, client nodes
    jetctl logs runs/x --task digits --since 10m
    jetctl logs --server policy --grep 'stale|refused' -f   # follow a live run; Ctrl-C quits

The lines come from `logs/<process>.jsonl` (jetctl.logs), on this host only: a node on
another host keeps its lines in its own run dir.
"""

from __future__ import annotations

import re
import time
from pathlib import Path
from typing import Annotated

import typer

from jetctl.cli.errors import fail


def logs(
    run_dir: Annotated[Path | None, typer.Argument(help="Default: runs/latest.")] = None,
    node: Annotated[str | None, typer.Option("--node", help="One process: digits-0, "
                                             "server-policy, controller.")] = None,
    task: Annotated[str | None, typer.Option("--task", help="The client nodes of a task.")] = None,
    server: Annotated[str | None, typer.Option("--server", help="A model's server.")] = None,
    follow: Annotated[bool, typer.Option("-f", "--follow", help="Keep printing new lines.")] = False,
    since: Annotated[str | None, typer.Option("--since", help="Only the last 90s, 10m, 2h, 1d.")] = None,
    grep: Annotated[str | None, typer.Option("--grep", help="A regular expression the message "
                                             "must match.")] = None,
) -> None:
    """Show the run's log lines from every process, in time order."""
    from jetctl import logs as L
    from jetctl.rundir import RunDirError, RunPaths, find_run_dir

    try:
        rd = find_run_dir(run_dir)
    except RunDirError as e:
        fail(str(e))
    try:
        start = None if since is None else L.parse_since(since, time.time())
    except ValueError as e:
        fail(str(e))
    try:
        pattern = None if grep is None else re.compile(grep)
    except re.error as e:
        fail(f"--grep {grep!r}: {e}")
    keep = L.LogFilter(node=node, task=task, server=server, since=start, grep=pattern)
    logs_dir = RunPaths(rd).logs
    lines = L.follow(logs_dir, keep) if follow else iter(L.read_lines(logs_dir, keep))
    try:
        for line in lines:
            typer.echo(line.render())
    except KeyboardInterrupt:
        pass  # Ctrl-C ends -f: not an error


def register(app: typer.Typer) -> None:
    app.command("logs")(logs)
