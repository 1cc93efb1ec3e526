"""`jetctl client`: run one client node of a task.

On any host, joining a running task (the controller names and counts the node, shows it in
`jetctl status`, drains it on `down` and on a swap):

    jetctl client --join 10.0.0.5:7000 --token $TOKEN --task digits

The controller starts its own nodes the same way (`JETCTL_CONTROL` and `JETCTL_TOKEN` in the
environment, `--task --index --revision --name` on the command line). Everything else comes
over the network from the controller (`Control.Join`): the task's settings, the agent of the
node's revision, the servers' endpoints; the node's status and ledger records go back
(`Control.Sync`). `--run-dir` is the node's own folder (its spool `spool/<name>.sqlite`); it
is never shared. The agent and env modules must be importable on the node's host.

Without a controller (tests, debugging): `jetctl client --recipe R --task T --run-dir D`
reads the server's endpoint from `D/servers/<model>.json` and writes its status to
`D/nodes/<name>.json`. SIGTERM drains (finish rollouts, flush the spool) and exits 0.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Annotated

import typer

from jetctl.cli.errors import fail

if TYPE_CHECKING:
    from jetctl.recipe import Recipe, TaskConfig
    from jetctl.tls import TlsFiles


def default_node_name(task: str, index: int) -> str:
    """`<task>-<index>`: the name the controller expects (`client_node_name`)."""
    return f"{task}-{index}"


def node_tls(mode: str | None, folder: Path | None, run_dir: Path) -> TlsFiles | None:
    """How a node dials (`--tls`, `--tls-dir`, else JETCTL_TLS_MODE / JETCTL_TLS_DIR, else
    plaintext); the folder defaults to `<run_dir>/tls`. Fails with one line when files are
    missing."""
    from jetctl.rundir import RunPaths
    from jetctl.tls import TLS_DIR_ENV, TLS_MODE_ENV, TlsError, TlsFiles

    mode = mode or os.environ.get(TLS_MODE_ENV) or "off"
    if mode == "off":
        return None
    if mode not in ("tls", "mtls"):
        fail(f"--tls must be off, tls or mtls, not {mode!r}")
    where = folder or Path(os.environ.get(TLS_DIR_ENV) or RunPaths(run_dir).tls)
    tls = TlsFiles(mode=mode, dir=where.resolve())  # type: ignore[arg-type]  # checked above
    try:
        tls.check("client")
    except TlsError as exc:
        fail(str(exc))
    return tls


def register(app: typer.Typer) -> None:
    @app.command("client")
    def client(
        task: Annotated[str, typer.Option("--task", help="The task to run (a key of tasks:).")],
        join: Annotated[
            str | None,
            typer.Option("--join", help="host:port of the run's controller (default: "
                         "$JETCTL_CONTROL); the node gets everything else from it."),
        ] = None,
        token: Annotated[
            str | None,
            typer.Option("--token", help="The run's token (default: $JETCTL_TOKEN, else "
                         "<run-dir>/token).", show_default=False),
        ] = None,
        recipe: Annotated[
            Path | None,
            typer.Option("--recipe", help="Without a controller: the recipe to read."),
        ] = None,
        run_dir: Annotated[
            Path, typer.Option("--run-dir", help="The node's own folder (its spool).")
        ] = Path("jetctl-node"),
        index: Annotated[
            int | None,
            typer.Option("--index", help="Node index within the task (seeds its task stream; "
                         "default: the controller picks)."),
        ] = None,
        revision: Annotated[
            str | None, typer.Option("--revision", help="Client revision tag.")
        ] = None,
        agent: Annotated[
            str | None,
            typer.Option("--agent", help="module:function overriding the revision's agent."),
        ] = None,
        max_groups: Annotated[
            int | None, typer.Option("--max-groups", help="Stop after this many groups.")
        ] = None,
        name: Annotated[
            str | None,
            typer.Option("--name", help="Node name (default: the controller names a joining "
                         "node; <task>-<index> without one)."),
        ] = None,
        drain_grace_s: Annotated[
            float, typer.Option("--drain-grace-s", help="Seconds to flush the spool on drain.")
        ] = 30.0,
        metrics_port: Annotated[
            int, typer.Option("--metrics-port", help="Port for /metrics (0: free port).")
        ] = 0,
        tls: Annotated[
            str | None,
            typer.Option("--tls", help="off | tls | mtls: how to dial the controller and the "
                         "servers (default: $JETCTL_TLS_MODE, else off)."),
        ] = None,
        tls_dir: Annotated[
            Path | None,
            typer.Option("--tls-dir", help="ca.pem (+ client.pem/.key for mtls); default: "
                         "$JETCTL_TLS_DIR, else <run-dir>/tls."),
        ] = None,
        log_level: Annotated[str, typer.Option("--log-level")] = "INFO",
    ) -> None:
        """Run a client node: rollouts of the task's agent, pushed to the model's server."""
        import asyncio
        import logging

        from jetctl.link import CONTROL_ENV
        from jetctl.logs import install_json_log
        from jetctl.models import quiet_model_libraries
        from jetctl.rundir import RunPaths

        logging.basicConfig(
            level=log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s"
        )
        quiet_model_libraries()  # its output is a log file: no progress bars, no FutureWarning
        if max_groups is not None and max_groups < 1:
            fail(f"--max-groups must be >= 1, got {max_groups}")
        control = join or os.environ.get(CONTROL_ENV)
        if control is None and recipe is None:
            fail("pass --join CONTROLLER_ADDR (a running run) or --recipe RECIPE (no controller)")
        run_dir = run_dir.resolve()
        # a node joining by hand without --name learns its name at Join: until then, its pid
        process = name or (default_node_name(task, index) if index is not None
                           else f"{task}-pid{os.getpid()}")
        install_json_log(RunPaths(run_dir), process, task=task)
        token = _token(token, run_dir)
        files = node_tls(tls, tls_dir, run_dir)
        options = _NodeOptions(
            task=task, index=index, revision=revision, agent=agent, name=name,
            max_groups=max_groups, drain_grace_s=drain_grace_s, metrics_port=metrics_port,
        )
        if control is not None:
            code = asyncio.run(_joined_node(control, token, files, run_dir, options))
        else:
            assert recipe is not None
            code = asyncio.run(_lone_node(_load_recipe(recipe), token, files, run_dir, options))
        raise typer.Exit(code)


@dataclass(frozen=True)
class _NodeOptions:
    task: str
    index: int | None
    revision: str | None
    agent: str | None
    name: str | None
    max_groups: int | None
    drain_grace_s: float
    metrics_port: int


async def _joined_node(
    control: str, token: str, tls: TlsFiles | None, run_dir: Path, o: _NodeOptions
) -> int:
    """Join the controller at `control`, then run the node it describes."""
    from jetctl.client.node import ClientNode, NodeConfig
    from jetctl.link import ControlLink, JoinRefused
    from jetctl.proto._gen import control_pb2 as cpb
    from jetctl.recipe import TaskConfig

    link = ControlLink(control, token, tls=tls)
    # a node the controller started has an index (and so its name); one joining by hand
    # has neither: the controller names it
    name = o.name or (default_node_name(o.task, o.index) if o.index is not None else "")
    try:
        reply = await link.join(cpb.JoinRequest(
            kind="client", task=o.task, name=name, revision=o.revision or "",
            index=-1 if o.index is None else o.index,
        ))
    except JoinRefused as e:
        await link.close()
        fail(f"the controller at {control} refused this node: {e}")
    if reply.ship_logs:  # its log files are not in the controller's run dir: send its lines
        from jetctl.logs import install_log_shipper

        link.log_shipper = install_log_shipper(reply.name, task=o.task)
    task_cfg = TaskConfig.model_validate_json(reply.task_json)
    config = NodeConfig(
        name=reply.name, task_name=o.task, task=task_cfg, run_dir=run_dir, token=token,
        tls=tls, index=reply.index, revision=reply.revision, agent=o.agent or reply.agent,
        max_groups=o.max_groups, drain_grace_s=o.drain_grace_s, metrics_port=o.metrics_port,
        endpoints=_endpoint_overrides(task_cfg), link=link,
        deterministic_run=reply.run if reply.deterministic else None,
    )
    return await ClientNode(config).run()


async def _lone_node(
    recipe: Recipe, token: str, tls: TlsFiles | None, run_dir: Path, o: _NodeOptions
) -> int:
    """A node without a controller: the recipe's task, the servers' endpoint files."""
    from jetctl.client.node import ClientNode, NodeConfig

    if o.task not in recipe.tasks:
        fail(f"task {o.task!r} is not in the recipe "
             f"(tasks: {', '.join(sorted(recipe.tasks)) or 'none'})")
    index = o.index or 0
    if tls is None:
        from jetctl.tls import tls_files

        tls = tls_files(recipe.run.tls, run_dir)
    config = NodeConfig(
        name=o.name or default_node_name(o.task, index), task_name=o.task,
        task=recipe.tasks[o.task], run_dir=run_dir, token=token, tls=tls, index=index,
        revision=o.revision or "default", agent=o.agent, max_groups=o.max_groups,
        drain_grace_s=o.drain_grace_s, metrics_port=o.metrics_port,
        endpoints=_endpoint_overrides(recipe.tasks[o.task]),
        deterministic_run=recipe.run.name if recipe.run.deterministic else None,
    )
    return await ClientNode(config).run()


def _endpoint_overrides(task: TaskConfig) -> dict[str, str]:
    """Chaos runs route clients through a network proxy (jetctl.netproxy): per model."""
    from jetctl.faults import endpoint_override

    return {m: e for m in task.models if (e := endpoint_override(m)) is not None}


def _token(given: str | None, run_dir: Path) -> str:
    from jetctl.rundir import RunDirError, read_token_for

    if given:
        return given
    try:
        return read_token_for(run_dir)
    except RunDirError as exc:
        fail(f"{exc}, or pass --token")


def _load_recipe(path: Path) -> Recipe:
    from jetctl.recipe import RecipeError, load_recipe

    try:
        return load_recipe(path)
    except RecipeError as e:
        fail(str(e))
