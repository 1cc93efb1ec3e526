"""One red line and exit code 1 for user errors (no tracebacks)."""

from __future__ import annotations

from typing import NoReturn

import typer
from rich.console import Console


class UserError(Exception):
    """An error the user can fix; the CLI prints its message in red and exits 1."""


def fail(message: str) -> NoReturn:
    Console(stderr=True).print(f"[red]error:[/red] {message}", highlight=False, soft_wrap=True)
    raise typer.Exit(1)
