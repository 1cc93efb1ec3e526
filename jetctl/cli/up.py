"""`jetctl up`, `jetctl down` (and the hidden `jetctl controller` that `up --detach` starts).

    jetctl up recipes/arith.yaml              # foreground, live view; Ctrl-C drains and exits
    jetctl up recipes/arith.yaml --detach     # background controller; returns once it is up
    jetctl up recipes/arith.yaml --resume     # adopt the nodes of a controller that died
    jetctl up recipes/arith.yaml --replay-from runs/arith   # re-train from the record (jetctl/run/rerun.py)
    jetctl down [--run-dir D] [--grace S]     # drain clients, then servers; wait for the end

The logic lives in `jetctl.controller`; this module parses flags and draws.
"""

from __future__ import annotations

import logging
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import TYPE_CHECKING, Annotated

import typer
from rich.console import Console
from rich.live import Live

from jetctl.cli.errors import fail
from jetctl.recipe import RayConfig, Recipe

if TYPE_CHECKING:
    from jetctl.controller.controller import Controller

LATEST_LINK = Path("runs/latest")
DETACH_TIMEOUT_S = 120.0


def load_recipe_or_fail(path: Path) -> Recipe:
    """The validated recipe, or every problem in red (with its line) and exit 1."""
    from jetctl.recipe import RecipeError, load_recipe

    try:
        return load_recipe(path)
    except RecipeError as e:
        fail(e.render())


def _configure_logging(log_file: Path, console: Console | None) -> None:
    """Controller events go to logs/controller.log and, in the foreground, above the live view."""
    from rich.logging import RichHandler

    root = logging.getLogger("jetctl")
    root.setLevel(logging.INFO)
    log_file.parent.mkdir(parents=True, exist_ok=True)
    fh = logging.FileHandler(log_file)
    fh.setFormatter(logging.Formatter("%(asctime)s %(levelname)s %(name)s: %(message)s"))
    root.addHandler(fh)
    if console is not None:
        root.addHandler(RichHandler(console=console, show_path=False, markup=False))


def up(
    recipe: Annotated[Path, typer.Argument(help="The recipe YAML.")],
    detach: Annotated[bool, typer.Option("--detach", help="Run the controller in the background.")] = False,
    resume: Annotated[bool, typer.Option("--resume", help="Adopt the nodes of an earlier controller.")] = False,
    run_dir: Annotated[Path | None, typer.Option("--run-dir", help="Default: the recipe's run.dir or runs/<run.name>.")] = None,
    grace: Annotated[float, typer.Option("--grace", help="Seconds each drain phase may take.")] = 30.0,
    replay_from: Annotated[Path | None, typer.Option(
        "--replay-from", help="Re-train from this run dir's recorded groups in the recorded "
        "order (no clients, no generation) into --run-dir (default: RUN_DIR-replay); exit 1 "
        "when a step differs from the record.")] = None,
) -> None:
    """Start a run: servers, then client nodes; restart what dies; drain on Ctrl-C."""
    from jetctl.logs import install_json_log
    from jetctl.run.status import document, finished_summary, render_progress, render_summary
    from jetctl.rundir import RunPaths

    rec = load_recipe_or_fail(recipe)
    if replay_from is not None:
        if detach or resume:
            fail("--replay-from re-trains in the foreground, without nodes: drop --detach "
                 "and --resume")
        _replay_from(rec, recipe, replay_from, run_dir)
        return
    rd = (run_dir or Path(rec.run_dir)).resolve()
    if detach:
        _detach(recipe, rd, resume, grace)
        return
    console = Console()
    _configure_logging(RunPaths(rd).controller_log, console)
    install_json_log(RunPaths(rd), "controller")
    ctl = _set_up_controller(rec, recipe, rd, resume, grace)
    loop = threading.Thread(target=ctl.serve_forever, name="reconcile")
    loop.start()
    with Live(console=console, refresh_per_second=2, transient=False) as live:
        while not ctl.wait(0.5):
            live.update(render_progress(document(ctl.status()), rec))
        live.update(render_progress(document(ctl.status()), rec))
    loop.join()
    console.line()
    console.print(render_summary(finished_summary(rd)))


def _replay_from(rec: Recipe, recipe: Path, source: Path, run_dir: Path | None) -> None:
    """`up --replay-from`: the recorded steps taken again (jetctl/run/rerun.py), one line a step,
    a verdict per model; exit 1 when a step differs from the record."""
    from jetctl.models import quiet_model_libraries
    from jetctl.run.replay import Comparison, ReplayError
    from jetctl.run.rerun import default_out, retrain

    if not source.is_dir():
        fail(f"--replay-from {source}: not a run dir (pass the folder `jetctl up` made)")
    out = (run_dir or default_out(source)).resolve()
    quiet_model_libraries()

    def said(model: str, c: Comparison) -> None:
        verdict = "identical" if c.identical else "differs: " + "; ".join(c.differences)
        typer.echo(f"{model} step {c.recorded.step}: loss {c.replayed.loss!r}, {verdict}")

    try:
        done = retrain(rec, recipe, source, out, on_step=said)
    except ReplayError as exc:
        fail(str(exc))
    for r in done:
        typer.echo(f"{r.model}: {r.steps} steps re-trained into {out} (weights sha256 "
                   f"{r.weights_sha256[:16]}), {r.verdict}")
    if not all(r.identical for r in done):
        raise typer.Exit(1)


def _detach(recipe: Path, run_dir: Path, resume: bool, grace: float) -> None:
    from jetctl.run.status import controller_alive
    from jetctl.rundir import RunPaths, peek_run_record

    paths = RunPaths(run_dir)
    paths.logs.mkdir(parents=True, exist_ok=True)
    argv = [sys.executable, "-m", "jetctl.cli.main", "controller", str(recipe.resolve()),
            "--run-dir", str(run_dir), "--grace", str(grace)]
    if resume:
        argv.append("--resume")
    with open(paths.controller_log, "ab") as log:
        offset = log.tell()
        proc = subprocess.Popen(argv, stdin=subprocess.DEVNULL, stdout=log,
                                stderr=subprocess.STDOUT, start_new_session=True)
    console = Console()
    deadline = time.monotonic() + DETACH_TIMEOUT_S
    with console.status("starting the controller…"):
        while time.monotonic() < deadline:
            code = proc.poll()
            if code is not None:
                tail = _log_tail(paths.controller_log, offset)
                fail(tail or f"the controller exited with code {code}; see {paths.controller_log}")
            info = peek_run_record(run_dir)  # None until the controller has written it
            if (info is not None and info.controller is not None
                    and info.controller.pid == proc.pid and info.state == "running"
                    and controller_alive(info)):
                break
            time.sleep(0.2)
        else:
            fail(f"the controller did not come up within {DETACH_TIMEOUT_S:.0f}s; see {paths.controller_log}")
    console.print(f"run started in the background (controller pid {proc.pid}), dir {run_dir}")
    console.print(f"  watch: jetctl status --run-dir {run_dir}")
    console.print(f"  stop:  jetctl down --run-dir {run_dir}")
    console.print(f"  log:   {paths.controller_log}")


def _log_tail(path: Path, offset: int, lines: int = 20) -> str:
    try:
        with open(path, "rb") as f:
            f.seek(offset)
            text = f.read().decode(errors="replace")
    except OSError:
        return ""
    tail = [ln for ln in text.strip().splitlines() if ln.strip()][-lines:]
    # the child printed "error: ..." through `fail`; don't repeat the prefix
    return "\n".join(tail).removeprefix("error: ")


def controller(
    recipe: Annotated[Path, typer.Argument()],
    run_dir: Annotated[Path, typer.Option("--run-dir")],
    resume: Annotated[bool, typer.Option("--resume")] = False,
    grace: Annotated[float, typer.Option("--grace")] = 30.0,
) -> None:
    """The background controller of `jetctl up --detach` (logs to stderr = logs/controller.log)."""
    from jetctl.logs import install_json_log
    from jetctl.rundir import RunPaths

    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    install_json_log(RunPaths(run_dir.resolve()), "controller")
    rec = load_recipe_or_fail(recipe)
    _set_up_controller(rec, recipe, run_dir, resume, grace).serve_forever()


def _set_up_controller(
    rec: Recipe, recipe: Path, run_dir: Path, resume: bool, grace: float
) -> Controller:
    """A controller with its run dir set up and its signal handlers installed."""
    from jetctl.controller.controller import Controller, ControllerOptions
    from jetctl.rundir import RunDirError

    ctl = Controller(
        rec, recipe, run_dir=run_dir, resume=resume, latest_link=LATEST_LINK,
        options=ControllerOptions(grace_s=grace),
    )
    try:
        ctl.setup()
    except RunDirError as e:
        fail(str(e))
    ctl.install_signal_handlers()
    return ctl


def down(
    run_dir: Annotated[Path | None, typer.Option("--run-dir", help="Default: runs/latest.")] = None,
    grace: Annotated[float, typer.Option("--grace", help="Seconds each drain phase may take.")] = 30.0,
) -> None:
    """Stop a run: drain clients, then servers, and wait until the controller exits."""
    import grpc

    from jetctl.link import call_control
    from jetctl.proto._gen import control_pb2 as cpb
    from jetctl.run.status import controller_alive
    from jetctl.rundir import RunDirError, find_run_dir, read_run_record, read_token_for
    from jetctl.tls import TlsFiles

    console = Console()
    try:
        rd = find_run_dir(run_dir)
        info = read_run_record(rd)
        run = info.run
        ctl = info.controller
        if ctl is None or not controller_alive(info):
            stopped = stop_orphans(rd, grace)
            console.print(f"the controller of run {run} was not running; stopped {stopped} node(s)")
            return
        token = read_token_for(rd)
        call_control(
            ctl.endpoint, token, "Down", cpb.DownRequest(grace_s=grace),
            tls=TlsFiles.from_json(info.tls),
        )
    except RunDirError as e:
        fail(str(e))
    except grpc.RpcError as e:
        fail(f"the controller did not take the request: {e.code().name}: {e.details()}")
    # clients drain, then servers: two phases of up to `grace` each, plus slack
    deadline = time.monotonic() + 2 * grace + 30
    with console.status(f"draining run {run}: clients, then servers…"):
        while controller_alive(info) and time.monotonic() < deadline:
            time.sleep(0.25)
    if controller_alive(info):
        fail(f"the controller (pid {ctl.pid}) is still draining; see {rd}/logs/controller.log")
    console.print(f"run {run} stopped")


def stop_orphans(run_dir: Path, grace: float) -> int:
    """Stop a dead controller's nodes from their pid files (clients first), then write the
    reward curve and mark run.json finished. Returns how many nodes were running."""
    from jetctl.controller.plot import write_reward_curve
    from jetctl.controller.runtimes.base import Runtime
    from jetctl.controller.runtimes.process import ProcessRuntime
    from jetctl.rundir import mark_run_finished

    runtimes: list[Runtime] = [ProcessRuntime(run_dir)]
    if _has_containers(run_dir):
        from jetctl.controller.runtimes.docker import DockerRuntime, RuntimeUnavailable

        try:
            runtimes.append(DockerRuntime(run_dir))
        except RuntimeUnavailable as e:
            Console(stderr=True).print(f"[yellow]warning:[/yellow] {e}; containers not stopped")
    ray = _ray_config(run_dir)
    if ray is not None:
        from jetctl.controller.runtimes.base import RuntimeUnavailable as Unavailable
        from jetctl.controller.runtimes.ray import RayRuntime

        try:
            runtimes.append(RayRuntime(*ray))
        except Unavailable as e:
            Console(stderr=True).print(f"[yellow]warning:[/yellow] {e}; Ray actors not stopped")
    handles = [(rt, h) for rt in runtimes for h in rt.list("")]
    for kind in ("client", "server"):
        for rt in runtimes:
            batch = [h for r, h in handles if r is rt and h.spec.kind == kind]
            rt.stop_all(batch, grace)
            for h in batch:
                rt.release(h)
    for rt in runtimes:
        rt.prune("")
    write_reward_curve(run_dir)
    mark_run_finished(run_dir, "jetctl down (its controller was not running)")
    return len(handles)


def _ray_config(run_dir: Path) -> tuple[str, RayConfig] | None:
    """(run name, run.ray) when the run's recipe places nodes on Ray."""
    from jetctl.recipe import RecipeError, load_recipe

    recipe = _recipe_of(run_dir)
    try:
        rec = load_recipe(recipe) if recipe else None
    except RecipeError:
        return None
    return (rec.run.name, rec.run.ray) if rec is not None and rec.uses_ray else None


def _recipe_of(run_dir: Path) -> str:
    """The recipe path run.json names ('' where run.json is missing or not a run's)."""
    from jetctl.rundir import RunDirError, read_run_record

    try:
        return read_run_record(run_dir).recipe
    except RunDirError:
        return ""


def _has_containers(run_dir: Path) -> bool:
    """The run's recipe puts a task on docker (then its containers are looked up by label)."""
    from jetctl.recipe import RecipeError, load_recipe

    recipe = _recipe_of(run_dir)
    try:
        return bool(recipe) and any(
            t.runtime == "docker" for t in load_recipe(recipe).tasks.values()
        )
    except RecipeError:
        return True  # the recipe changed or went away: look anyway


def register(app: typer.Typer) -> None:
    app.command("up")(up)
    app.command("down")(down)
    app.command("controller", hidden=True)(controller)


__all__ = ["load_recipe_or_fail", "register", "stop_orphans"]
