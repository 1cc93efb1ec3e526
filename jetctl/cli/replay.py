"""`jetctl replay RUN_DIR --model M --step N`, `jetctl replay step-N.tar` and
`jetctl bundle RUN_DIR --model M --step N --out step-N.tar`.

A thin entry point: the logic is in jetctl/run/replay.py. Replay prints `identical` and exits 0
when the recomputed step is bitwise the recorded one; otherwise it prints each difference
and exits 1.
"""

from __future__ import annotations

from pathlib import Path
from typing import Annotated, Any

import typer

from jetctl.cli.errors import fail


def _run_parts(run_dir: Path, model: str | None) -> tuple[Any, str, Path, Path, Any]:
    """(model config, model name, store, step log, checkpoint root) of a run dir's model;
    the root signed with the server's key when it has one (as the server reads it)."""
    from jetctl import auth
    from jetctl.rundir import RunPaths
    from jetctl.server.checkpoint import CHECKPOINT_KEY, SignedDir
    from jetctl.server.trained import TrainedError, open_source

    try:
        source = open_source(run_dir)
        if source.run_dir is None:
            fail(f"{run_dir} is not a run dir (pass the folder `jetctl up` made)")
        name = source.model_name(model)
        root: Any = source.checkpoint_root(name)
    except TrainedError as exc:
        fail(str(exc))
    paths = RunPaths(source.run_dir)
    key = paths.server_dir(name) / CHECKPOINT_KEY
    if key.is_file():
        root = SignedDir(root, auth.read_private(key))
    return (source.recipe.models[name], name, paths.store(name), paths.steps_log(name), root)


def register(app: typer.Typer) -> None:
    @app.command("replay")
    def replay_command(
        target: Annotated[Path, typer.Argument(help="A run dir, or a step bundle (.tar).")],
        model: Annotated[str | None, typer.Option("--model", help="The recipe's model "
                                                  "(default: its only one).")] = None,
        step: Annotated[int | None, typer.Option("--step", help="The step to replay (the "
                                                 "model version after it); a run dir only.")]
        = None,
    ) -> None:
        """Recompute one training step from the run's record and compare it bit for bit."""
        from jetctl.models import quiet_model_libraries
        from jetctl.run.replay import ReplayError, replay_bundle, replay_run_step

        quiet_model_libraries()
        try:
            if target.is_file():
                if step is not None or model is not None:
                    fail("a bundle holds one step of one model: drop --step and --model")
                comparison = replay_bundle(target)
            else:
                if step is None:
                    fail("pass --step N (the model version after the step to replay)")
                cfg, _, store, steps_log, root = _run_parts(target, model)
                comparison = replay_run_step(cfg, store, steps_log, root, step)
        except ReplayError as exc:
            fail(str(exc))
        if comparison.identical:
            r = comparison.replayed
            typer.echo(f"identical: step {comparison.recorded.step} (loss {r.loss!r}, "
                       f"grad norm {r.grad_norm!r}, weights sha256 {r.weights_sha256[:16]})")
            return
        typer.echo(f"step {comparison.recorded.step}: differs")
        for line in comparison.differences:
            typer.echo(f"  {line}")
        raise typer.Exit(1)

    @app.command("bundle")
    def bundle_command(
        run_dir: Annotated[Path, typer.Argument(help="The run dir.")],
        step: Annotated[int, typer.Option("--step", help="The step to bundle.")],
        out: Annotated[Path, typer.Option("--out", help="The tar file to write.")],
        model: Annotated[str | None, typer.Option("--model", help="The recipe's model "
                                                  "(default: its only one).")] = None,
    ) -> None:
        """Write one training step as a portable bundle that `jetctl replay` reads."""
        from jetctl.models import quiet_model_libraries
        from jetctl.run.replay import ReplayError, write_bundle

        quiet_model_libraries()
        cfg, name, store, steps_log, root = _run_parts(run_dir, model)
        try:
            done = write_bundle(cfg, name, store, steps_log, root, step, out)
        except ReplayError as exc:
            fail(str(exc))
        typer.echo(f"wrote step {step} of {name}: {done}")
