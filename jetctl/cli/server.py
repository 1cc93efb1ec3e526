"""`jetctl server`: run one swarm server (the controller starts these; you rarely need to)."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer

from jetctl.cli.errors import fail


def register(app: typer.Typer) -> None:
    @app.command("server")
    def server(
        recipe: Annotated[Path, typer.Option(help="Recipe YAML.")],
        model: Annotated[str, typer.Option(help="Key under `models:` to serve and train.")],
        run_dir: Annotated[Path, typer.Option(help="The run directory.")],
        port: Annotated[int, typer.Option(help="gRPC port (0: any free port).")] = 0,
        metrics_port: Annotated[int, typer.Option(help="Prometheus port (0: any).")] = 0,
        no_train: Annotated[bool, typer.Option(help="Serve and store only.")] = False,
    ) -> None:
        """Run one swarm server: generation, trajectory store, trainer, checkpoints."""
        import asyncio
        import logging

        from jetctl.models import quiet_model_libraries
        from jetctl.recipe import RecipeError, load_recipe
        from jetctl.rundir import RunDirError, read_token_for
        from jetctl.server.app import ServerOptions, serve
        from jetctl.tls import TlsError, tls_files

        logging.basicConfig(
            level=logging.INFO, format="%(asctime)s %(name)s %(levelname)s %(message)s"
        )
        quiet_model_libraries()  # its output is a log file: no progress bars, no FutureWarning
        try:
            rec = load_recipe(recipe)
        except RecipeError as exc:  # every issue, one line each
            fail(str(exc))
        if model not in rec.models:
            fail(f"model {model!r} is not in {recipe} (models: {', '.join(rec.models)})")
        tls = tls_files(rec.run.tls, run_dir)
        try:
            if tls is not None:
                tls.check("server")
        except TlsError as exc:
            fail(str(exc))
        try:
            token = read_token_for(run_dir)
        except RunDirError as exc:
            fail(str(exc))
        opts = ServerOptions(
            name=model, cfg=rec.models[model], run_dir=run_dir.resolve(),
            token=token, port=port, metrics_port=metrics_port,
            train=not no_train, tls=tls,
        )
        raise typer.Exit(asyncio.run(serve(opts)))
