"""`jetctl bench ...`: benchmarks that print side-by-side figures and ratios from one run.

One module per subcommand, each with a `register(bench)`.
"""

from __future__ import annotations

import typer

from jetctl.cli.bench import ingest, loop, merge, pull, scale, soak, tools


def register(app: typer.Typer) -> None:
    bench = typer.Typer(help="Benchmarks: figures measured side by side in one run.",
                        no_args_is_help=True)
    app.add_typer(bench, name="bench")
    for command in (loop, ingest, pull, scale, merge, soak, tools):
        command.register(bench)
