"""`jetctl server`: run one swarm server (the controller starts these; you rarely need to).

    jetctl server --join 10.0.0.5:7000 --token $TOKEN --model policy     # models.policy.runtime: external
    jetctl server --recipe R --model policy --run-dir D --no-train       # no controller (benchmarks)

With a controller (`--join`, or `JETCTL_CONTROL` when the controller starts it) the server
gets `models.<model>` from `Control.Join` and syncs its advertised endpoint, the revisions it
refuses and its store's ledger records; `--run-dir` is its own folder (store, checkpoints).
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import TYPE_CHECKING, Annotated

import typer

from jetctl.cli.errors import fail

if TYPE_CHECKING:
    from jetctl.link import ControlLink
    from jetctl.recipe import ModelConfig
    from jetctl.tls import TlsFiles
    from jetctl.trackers import TrackingPlan


def register(app: typer.Typer) -> None:
    @app.command("server")
    def server(
        model: Annotated[str, typer.Option(help="Key under `models:` to serve and train.")],
        join: Annotated[
            str | None,
            typer.Option("--join", help="host:port of the run's controller (default: "
                         "$JETCTL_CONTROL)."),
        ] = None,
        token: Annotated[
            str | None,
            typer.Option("--token", help="The run's token (default: $JETCTL_TOKEN, else "
                         "<run-dir>/token).", show_default=False),
        ] = None,
        recipe: Annotated[
            Path | None, typer.Option(help="Without a controller: the recipe to read.")
        ] = None,
        run_dir: Annotated[
            Path, typer.Option(help="The server's own folder (store, checkpoints).")
        ] = Path("jetctl-server"),
        port: Annotated[int | None, typer.Option(help="gRPC port (default: models.<m>.port; "
                                                 "0: any free port).")] = None,
        metrics_port: Annotated[int, typer.Option(help="Prometheus port (0: any).")] = 0,
        no_train: Annotated[bool, typer.Option(help="Serve and store only.")] = False,
        tls: Annotated[
            str | None,
            typer.Option("--tls", help="off | tls | mtls (default: $JETCTL_TLS_MODE, else off; "
                         "without a controller: the recipe's run.tls)."),
        ] = None,
        tls_dir: Annotated[
            Path | None,
            typer.Option("--tls-dir", help="ca.pem, server.pem/.key (+ client.pem/.key to dial "
                         "an mtls controller); default: $JETCTL_TLS_DIR, else <run-dir>/tls."),
        ] = None,
    ) -> None:
        """Run one swarm server: generation, trajectory store, trainer, checkpoints."""
        import asyncio
        import logging

        from jetctl.link import CONTROL_ENV
        from jetctl.logs import install_json_log
        from jetctl.models import quiet_model_libraries
        from jetctl.rundir import RunPaths

        logging.basicConfig(
            level=logging.INFO, format="%(asctime)s %(name)s %(levelname)s %(message)s"
        )
        quiet_model_libraries()  # its output is a log file: no progress bars, no FutureWarning
        control = join or os.environ.get(CONTROL_ENV)
        if control is None and recipe is None:
            fail("pass --join CONTROLLER_ADDR (a running run) or --recipe RECIPE (no controller)")
        run_dir = run_dir.resolve()
        install_json_log(RunPaths(run_dir), f"server-{model}", model=model)
        token = _token(token, run_dir)
        if control is not None:
            code = asyncio.run(_joined_server(control, token, model, run_dir, port,
                                              metrics_port, no_train, tls, tls_dir))
        else:
            assert recipe is not None
            code = asyncio.run(_lone_server(recipe, token, model, run_dir, port, metrics_port,
                                            no_train, tls, tls_dir))
        raise typer.Exit(code)


async def _joined_server(
    control: str, token: str, model: str, run_dir: Path, port: int | None, metrics_port: int,
    no_train: bool, tls_mode: str | None, tls_dir: Path | None,
) -> int:
    from pydantic import ValidationError

    from jetctl.cli.client import node_tls
    from jetctl.link import ControlLink, JoinRefused
    from jetctl.proto._gen import control_pb2 as cpb
    from jetctl.recipe import ModelConfig
    from jetctl.trackers import TrackingPlan

    tls = node_tls(tls_mode, tls_dir, run_dir)
    link = ControlLink(control, token, tls=tls)
    try:
        reply = await link.join(cpb.JoinRequest(kind="server", model=model, index=-1))
    except JoinRefused as e:
        await link.close()
        fail(f"the controller at {control} refused this server: {e}")
    if reply.ship_logs:  # its log files are not in the controller's run dir: send its lines
        from jetctl.logs import install_log_shipper

        link.log_shipper = install_log_shipper(reply.name, model=model)
    cfg = ModelConfig.model_validate_json(reply.model_json)
    if (json.loads(reply.recipe_json or "{}").get("run") or {}).get("deterministic"):
        from jetctl.deterministic import use_deterministic_torch

        use_deterministic_torch()  # before the model loads, as `--recipe` does
    try:
        tracking = TrackingPlan.from_json(reply.recipe_json)
    except ValidationError as exc:  # a tracker the recipe names is not installed here
        await link.close()
        fail(f"run.trackers: {exc.errors()[0]['msg']}")
    return await _serve(model, cfg, token, run_dir, port, metrics_port, no_train, tls, link,
                        tracking)


async def _lone_server(
    recipe: Path, token: str, model: str, run_dir: Path, port: int | None, metrics_port: int,
    no_train: bool, tls_mode: str | None, tls_dir: Path | None,
) -> int:
    from jetctl.cli.client import node_tls
    from jetctl.deterministic import use_deterministic_torch
    from jetctl.recipe import RecipeError, load_recipe
    from jetctl.tls import tls_files
    from jetctl.trackers import TrackingPlan

    try:
        rec = load_recipe(recipe)
    except RecipeError as exc:  # every issue, one line each
        fail(str(exc))
    if model not in rec.models:
        fail(f"model {model!r} is not in {recipe} (models: {', '.join(rec.models)})")
    tls = node_tls(tls_mode, tls_dir, run_dir) if tls_mode else tls_files(rec.run.tls, run_dir)
    if rec.run.deterministic:  # the trainer's (and the engine's) torch ops: deterministic ones
        use_deterministic_torch()
    return await _serve(model, rec.models[model], token, run_dir, port, metrics_port, no_train,
                        tls, None, TrackingPlan.from_recipe(rec))


async def _serve(
    model: str, cfg: ModelConfig, token: str, run_dir: Path, port: int | None,
    metrics_port: int, no_train: bool, tls: TlsFiles | None, link: ControlLink | None,
    tracking: TrackingPlan | None,
) -> int:
    from jetctl.server.app import ServerOptions, serve
    from jetctl.tls import TlsError

    try:
        if tls is not None:
            tls.check("server")
    except TlsError as exc:
        fail(str(exc))
    opts = ServerOptions(
        name=model, cfg=cfg, run_dir=run_dir, token=token,
        port=cfg.port if port is None else port, metrics_port=metrics_port,
        train=not no_train, tls=tls, link=link, tracking=tracking,
    )
    return await serve(opts)


def _token(given: str | None, run_dir: Path) -> str:
    from jetctl.rundir import RunDirError, read_token_for

    if given:
        return given
    try:
        return read_token_for(run_dir)
    except RunDirError as exc:
        fail(f"{exc}, or pass --token")
