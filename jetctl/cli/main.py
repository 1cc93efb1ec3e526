"""`jetctl`: the command-line entry point. Each command group registers itself from its module.

Run `jetctl --help`. Heavy imports (torch, transformers, grpc) happen inside commands so
that `--help` and `validate` stay fast.
"""

from __future__ import annotations

import importlib
import sys

import typer

from jetctl import __version__

# modules under jetctl.cli that define `register(app: typer.Typer) -> None`
COMMAND_MODULES = (
    "up", "status", "validate", "server", "client", "models", "bench", "swap", "images",
    "chaos", "eval", "export", "logs", "research", "view", "replay",
)


def build_app() -> typer.Typer:
    app = typer.Typer(
        name="jetctl",
        help="Train LLM agents with RL on a swarm: servers train, clients roll out.",
        no_args_is_help=True,
        add_completion=False,
        pretty_exceptions_enable=False,
    )

    @app.callback(invoke_without_command=True)
    def _root(
        version: bool = typer.Option(False, "--version", help="Print the version and exit."),
    ) -> None:
        if version:
            typer.echo(__version__)
            raise typer.Exit(0)

    for name in COMMAND_MODULES:
        importlib.import_module(f"jetctl.cli.{name}").register(app)
    return app


def main() -> None:
    app = build_app()
    sys.exit(app())


if __name__ == "__main__":
    main()
