"""`jetctl client` (placeholder until its owner fills it in)."""

from __future__ import annotations

import typer


def register(app: typer.Typer) -> None:
    """Registers nothing yet."""
