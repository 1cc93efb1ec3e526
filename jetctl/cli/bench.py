"""`jetctl bench ...`: benchmarks that print side-by-side figures and ratios from one run."""

from __future__ import annotations

from typing import Annotated

import typer


def register(app: typer.Typer) -> None:
    bench = typer.Typer(help="Benchmarks: figures measured side by side in one run.",
                        no_args_is_help=True)
    app.add_typer(bench, name="bench")

    @bench.command("ingest")
    def ingest(
        clients: Annotated[int, typer.Option(help="Concurrent clients (one channel each).")] = 50,
        seconds: Annotated[float, typer.Option(help="Seconds per mode.")] = 10.0,
        group_bytes: Annotated[int, typer.Option(help="Approximate bytes per group.")] = 4096,
        processes: Annotated[int, typer.Option(help="Client processes.")] = 2,
    ) -> None:
        """Groups/s a real server acks (durably) from K clients; unary vs streaming."""
        from rich.console import Console
        from rich.table import Table

        from jetctl.bench.ingest import run

        console = Console()
        with console.status(f"starting a server and {clients} clients..."):
            results = run(clients=clients, seconds=seconds, group_bytes=group_bytes,
                          processes=processes)
        table = Table(title=f"jetctl bench ingest: {clients} clients, ~{group_bytes} B groups")
        for col in ("mode", "groups/s", "MB/s", "p50 ack ms", "p99 ack ms", "not accepted",
                    "vs unary"):
            table.add_column(col, justify="right")
        base = results[0].groups_per_s
        for r in results:
            table.add_row(r.mode, f"{r.groups_per_s:,.0f}", f"{r.mb_per_s:.1f}",
                          f"{r.p50_ms:.1f}", f"{r.p99_ms:.1f}", str(r.non_accepted),
                          f"{r.groups_per_s / base:.2f}x")
        console.print(table)
