"""`jetctl swap-clients`: replace a task's client nodes by a new revision, training on.

    jetctl swap-clients --task web --image jetctl-web:v2            # runtime: docker
    jetctl swap-clients --task digits --agent agents.digits:agent   # new agent code
    jetctl swap-clients --task web --agent agents.web:agent --drop-old --grace 60

The run's controller starts the new revision's nodes (`<task>-<index>-<rev>`), waits until
each reports running, then drains the old ones (they finish or time out their rollouts and
flush their spools within `--grace`). `--drop-old` also makes the task's server refuse the
old revision's trajectories (ack REVISION). The logic is `Controller.swap_clients`.
"""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer
from rich.console import Console

from jetctl.cli.errors import fail

HEALTHY_TIMEOUT_S = 180.0  # Controller.swap_clients' default wait for the new nodes


def swap_clients(
    task: Annotated[str, typer.Option("--task", help="Key under tasks: in the recipe.")],
    image: Annotated[
        str | None,
        typer.Option("--image", help="Docker image of the new revision (runtime: docker)."),
    ] = None,
    agent: Annotated[
        str | None, typer.Option("--agent", help="module:function of the new revision's agent.")
    ] = None,
    grace: Annotated[
        float, typer.Option("--grace", help="Seconds the old nodes get to drain.")
    ] = 30.0,
    drop_old: Annotated[
        bool, typer.Option("--drop-old", help="Have the server refuse the old revision's work.")
    ] = False,
    run_dir: Annotated[Path | None, typer.Option("--run-dir", help="Default: runs/latest.")] = None,
) -> None:
    """Swap a task's client nodes to a new revision (new image or agent); training goes on."""
    import grpc

    from jetctl.link import call_control
    from jetctl.proto._gen import control_pb2 as cpb
    from jetctl.run.status import controller_alive
    from jetctl.rundir import RunDirError, find_run_dir, read_run_record, read_token_for
    from jetctl.tls import TlsFiles

    if not image and not agent:
        fail("pass --image IMAGE (runtime: docker) or --agent module:function")
    if grace <= 0:
        fail(f"--grace must be > 0 seconds, got {grace:g}")
    console = Console()
    try:
        rd = find_run_dir(run_dir)
        info = read_run_record(rd)
        if info.controller is None or not controller_alive(info):
            fail(f"the controller of {rd} is not running: start it with `jetctl up --resume`")
        endpoint = info.controller.endpoint
        token = read_token_for(rd)
    except RunDirError as e:
        fail(str(e))
    request = cpb.SwapRequest(
        task=task, image=image or "", agent=agent or "", grace_s=grace, drop_old=drop_old
    )
    what = f"image {image}" if image else f"agent {agent}"
    try:
        with console.status(f"swapping {task} to {what}: new nodes first, then draining the old…"):
            reply = call_control(
                endpoint,
                token,
                "SwapClients",
                request,
                timeout_s=HEALTHY_TIMEOUT_S + grace + 60,
                tls=TlsFiles.from_json(info.tls),
            )
    except grpc.RpcError as e:
        fail(f"swap refused: {e.details() or e.code().name}")
    console.print(f"swapped to revision {reply.revision}: {reply.message}")


def register(app: typer.Typer) -> None:
    app.command("swap-clients")(swap_clients)
