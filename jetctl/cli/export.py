"""`jetctl export RUN_DIR --out DIR [--merged | --adapter] [--model M] [--step N]`.

A thin entry point: the logic is in jetctl/run/export.py.
"""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer

from jetctl.cli.errors import fail


def register(app: typer.Typer) -> None:
    @app.command("export")
    def export_command(
        run_dir: Annotated[Path, typer.Argument(help="The run dir (or its recipe).")],
        out: Annotated[Path, typer.Option("--out", help="The folder to write (new or empty).")],
        merged: Annotated[bool, typer.Option("--merged", help="A Hugging Face model folder "
                                             "with the LoRA merged (the default).")] = False,
        adapter: Annotated[bool, typer.Option("--adapter", help="A PEFT adapter folder.")] = False,
        model: Annotated[str | None, typer.Option("--model", help="The recipe's model "
                                                  "(default: its only one).")] = None,
        step: Annotated[int | None, typer.Option("--step", help="The checkpoint's step "
                                                 "(default: the latest).")] = None,
    ) -> None:
        """Write the trained model at a checkpoint as a merged model or a PEFT adapter."""
        if merged and adapter:
            fail("pass --merged or --adapter, not both")
        from jetctl.models import quiet_model_libraries
        from jetctl.run.export import export
        from jetctl.server.trained import TrainedError, open_source

        quiet_model_libraries()
        try:
            done = export(open_source(run_dir), out, "adapter" if adapter else "merged",
                          model=model, step=step)
        except TrainedError as exc:
            fail(str(exc))
        typer.echo(f"wrote {done.model} at step {done.checkpoint.step} as a {done.form} "
                   f"folder: {done.out}")
