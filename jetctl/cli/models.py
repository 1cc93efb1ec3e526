"""`jetctl models`: prepare builtin models in the cache and list them.

    jetctl models prepare builtin:smollm2-135m-instruct   # convert once (~30-60 s), print the folder
    jetctl models list                                    # builtins and what is cached

Heavy imports (torch, transformers) happen inside `prepare` only. Logic is in jetctl.models.
"""

from __future__ import annotations

import typer


def register(app: typer.Typer) -> None:
    """Adds the `models` sub-app to `app`."""
    models_app = typer.Typer(
        help="Prepare and list models (builtins are built offline into the cache).",
        no_args_is_help=True,
    )

    @models_app.command("prepare")
    def prepare(
        source: str = typer.Argument(
            ..., help="builtin:tiny, builtin:smollm2-135m-instruct, a folder, or a cached repo id."
        ),
    ) -> None:
        """Build or convert SOURCE into the cache (with progress) and print its folder."""
        from jetctl.cli.errors import fail
        from jetctl.models import ModelSourceError, resolve_model_dir

        try:
            folder = resolve_model_dir(source, progress=True)
        except ModelSourceError as exc:
            fail(str(exc))
        typer.echo(str(folder))

    @models_app.command("list")
    def list_models() -> None:
        """Builtin sources, and which are already built in the cache."""
        from rich.console import Console
        from rich.table import Table

        from jetctl.models import BUILTINS, cache_dir, cached_models

        cached = {p.name: p for p in cached_models()}
        table = Table(title=f"models (cache: {cache_dir() / 'models'})")
        table.add_column("source")
        table.add_column("cached")
        table.add_column("description")
        for source, description in BUILTINS.items():
            folder = cached.pop(source.removeprefix("builtin:"), None)
            table.add_row(source, str(folder) if folder else "no", description)
        for name, folder in cached.items():
            table.add_row(name, str(folder), "(not a known builtin)")
        Console().print(table)

    app.add_typer(models_app, name="models")
