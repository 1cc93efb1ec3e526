"""`jetctl client`: run one client node of a task (normally started by the controller).

    jetctl client --recipe recipes/digits.yaml --task digits --index 0 --run-dir runs/x

The token comes from `$JETCTL_TOKEN` or `<run_dir>/token` (jetctl.rundir); the server
endpoint from `<run_dir>/servers/<model>.json`. SIGTERM drains (finish rollouts, flush the spool) and
exits 0. The node's name is `<task>-<index>` (or `--name`); it names the status file
`<run_dir>/nodes/<name>.json`, the spool `<run_dir>/spool/<name>.sqlite`.
"""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Annotated

import typer

from jetctl.cli.errors import fail

if TYPE_CHECKING:
    from jetctl.recipe import Recipe


def default_node_name(task: str, index: int) -> str:
    """`<task>-<index>`: the name the controller expects (`client_node_name`)."""
    return f"{task}-{index}"


def register(app: typer.Typer) -> None:
    @app.command("client")
    def client(
        recipe: Annotated[Path, typer.Option("--recipe", help="Recipe YAML.")],
        task: Annotated[str, typer.Option("--task", help="Key under tasks: in the recipe.")],
        run_dir: Annotated[Path, typer.Option("--run-dir", help="The run directory.")],
        index: Annotated[
            int, typer.Option("--index", help="Node index within the task (seeds its task stream).")
        ] = 0,
        revision: Annotated[
            str | None, typer.Option("--revision", help="Client revision tag.")
        ] = None,
        agent: Annotated[
            str | None,
            typer.Option("--agent", help="module:function overriding the recipe's agent."),
        ] = None,
        max_groups: Annotated[
            int | None, typer.Option("--max-groups", help="Stop after this many groups.")
        ] = None,
        name: Annotated[
            str | None, typer.Option("--name", help="Node name (default <task>-<index>).")
        ] = None,
        drain_grace_s: Annotated[
            float, typer.Option("--drain-grace-s", help="Seconds to flush the spool on drain.")
        ] = 30.0,
        metrics_port: Annotated[
            int, typer.Option("--metrics-port", help="Port for /metrics (0: free port).")
        ] = 0,
        log_level: Annotated[str, typer.Option("--log-level")] = "INFO",
    ) -> None:
        """Run a client node: rollouts of the task's agent, pushed to the model's server."""
        import asyncio
        import logging

        from jetctl.models import quiet_model_libraries
        from jetctl.rundir import RunDirError, read_token_for

        logging.basicConfig(
            level=log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s"
        )
        quiet_model_libraries()  # its output is a log file: no progress bars, no FutureWarning
        recipe_obj = _load_recipe(recipe)
        if task not in recipe_obj.tasks:
            fail(
                f"task {task!r} is not in {recipe} (tasks: {', '.join(sorted(recipe_obj.tasks)) or 'none'})"
            )
        if max_groups is not None and max_groups < 1:
            fail(f"--max-groups must be >= 1, got {max_groups}")
        try:
            token = read_token_for(run_dir)
        except RunDirError as exc:
            fail(str(exc))
        from jetctl.tls import TlsError, tls_files

        tls = tls_files(recipe_obj.run.tls, run_dir)
        try:
            if tls is not None:
                tls.check("client")
        except TlsError as exc:
            fail(str(exc))

        from jetctl.client.node import ClientNode, NodeConfig
        from jetctl.faults import endpoint_override

        config = NodeConfig(
            name=name or default_node_name(task, index),
            task_name=task,
            task=recipe_obj.tasks[task],
            run_dir=run_dir,
            token=token,
            tls=tls,
            index=index,
            revision=revision or "default",
            agent=agent,
            max_groups=max_groups,
            drain_grace_s=drain_grace_s,
            metrics_port=metrics_port,
            # chaos runs route clients through a network proxy (jetctl.netproxy)
            endpoints={
                m: e for m in recipe_obj.tasks[task].models
                if (e := endpoint_override(m)) is not None
            },
        )
        raise typer.Exit(asyncio.run(ClientNode(config).run()))


def _load_recipe(path: Path) -> Recipe:
    from jetctl.recipe import RecipeError, load_recipe

    try:
        return load_recipe(path)
    except RecipeError as e:
        fail(str(e))
