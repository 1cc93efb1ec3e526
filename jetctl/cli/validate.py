"""`jetctl validate FILE...`: check recipes without starting anything.

Prints `ok: FILE (N models, M tasks)` for each valid recipe and every issue of the others
in red, one line each (`FILE:LINE: key.path = value: constraint and fix`); exits 1 when
any file has an issue. Agent and env modules are not imported, only their
`module:function` syntax is checked.
"""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer
from rich.console import Console
from rich.text import Text

from jetctl.recipe import RecipeError, load_recipe


def _plural(n: int, word: str) -> str:
    return f"{n} {word}" if n == 1 else f"{n} {word}s"


def validate_files(files: list[Path], out: Console, err: Console) -> bool:
    """Validate each file, print the outcome; True when every file is valid."""
    all_ok = True
    for file in files:
        try:
            recipe = load_recipe(file)
        except RecipeError as error:
            all_ok = False
            for issue in error.issues:
                err.print(Text(issue.render(), style="red"), soft_wrap=True)
            continue
        counts = f"{_plural(len(recipe.models), 'model')}, {_plural(len(recipe.tasks), 'task')}"
        out.print(Text(f"ok: {file} ({counts})"), soft_wrap=True)
    return all_ok


def register(app: typer.Typer) -> None:
    @app.command("validate")
    def validate(
        files: Annotated[
            list[Path], typer.Argument(metavar="FILE", help="Recipe YAML files to check.")
        ],
    ) -> None:
        """Check recipes and report every error at once, with its line and the fix."""
        ok = validate_files(files, Console(highlight=False), Console(stderr=True, highlight=False))
        if not ok:
            raise typer.Exit(1)
