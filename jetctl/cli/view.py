"""`jetctl view` and `jetctl trace`: the trajectory explorer of a run, live or finished.

    jetctl view                      # runs/latest on http://127.0.0.1:8765/
    jetctl view runs/x --port 9000 --host 0.0.0.0   # elsewhere: the run's token is required
    jetctl trace TRAJECTORY_ID [RUN_DIR] [--json]

Both read the run's stores read-only (jetctl.view.stores).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Annotated

import typer

from jetctl.cli.errors import fail

LOOPBACK = ("127.0.0.1", "localhost", "::1")


def view(
    run_dir: Annotated[Path | None, typer.Argument(help="Default: runs/latest.")] = None,
    port: Annotated[int, typer.Option("--port", help="0: any free port.")] = 8765,
    host: Annotated[str, typer.Option("--host", help="Bind address; other than loopback "
                                      "needs the run's token of every request.")] = "127.0.0.1",
) -> None:
    """Serve the run's trajectory explorer (it prints the URL)."""
    import socket

    import uvicorn

    from jetctl.rundir import RunDirError, find_run_dir, read_token_for
    from jetctl.view.app import make_app

    try:
        rd = find_run_dir(run_dir)
        token = None if host in LOOPBACK else read_token_for(rd)
    except RunDirError as e:
        fail(str(e))
    if port < 0 or port > 65535:
        fail(f"--port {port}: use 0 (any free port) to 65535")
    sock = socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET)
    try:
        sock.bind((host, port))
    except OSError as e:
        fail(f"cannot bind {host}:{port}: {e.strerror}; pick another --port")
    shown = f"[{host}]" if ":" in host else host
    url = f"http://{shown}:{sock.getsockname()[1]}/"
    typer.echo(url + ("" if token is None else "?token=<the run's token>"), err=False)
    server = uvicorn.Server(uvicorn.Config(make_app(rd, token), log_level="warning"))
    try:
        server.run(sockets=[sock])
    except KeyboardInterrupt:
        pass  # Ctrl-C ends it: not an error


def trace(
    trajectory_id: Annotated[str, typer.Argument(help="A trajectory id (from the explorer, "
                                                 "a spool or a log line).")],
    run_dir: Annotated[Path | None, typer.Argument(help="Default: runs/latest.")] = None,
    as_json: Annotated[bool, typer.Option("--json", help="One JSON object.")] = False,
) -> None:
    """The lineage of one trajectory: task row, node, revision, versions per turn, admission,
    the step that trained it and the first checkpoint holding that step."""
    from jetctl.rundir import RunDirError, find_run_dir
    from jetctl.view.stores import RunView

    try:
        rd = find_run_dir(run_dir)
    except RunDirError as e:
        fail(str(e))
    t = RunView(rd).trace(trajectory_id)
    if t.row is None and not t.status:
        fail(f"no store or spool under {rd} holds trajectory {trajectory_id}")
    typer.echo(json.dumps(t.json(), indent=1) if as_json else t.render())


def register(app: typer.Typer) -> None:
    app.command("view")(view)
    app.command("trace")(trace)
