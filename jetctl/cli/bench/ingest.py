"""`jetctl bench ingest`: groups/s a real server acks from K clients (jetctl.bench.ingest)."""

from __future__ import annotations

from typing import Annotated

import typer


def register(bench: typer.Typer) -> None:
    @bench.command("ingest")
    def ingest(
        clients: Annotated[int, typer.Option(help="Concurrent clients (one channel each).")] = 50,
        seconds: Annotated[float, typer.Option(help="Seconds per mode.")] = 10.0,
        group_bytes: Annotated[int, typer.Option(help="Approximate bytes per group.")] = 4096,
        processes: Annotated[int, typer.Option(help="Client processes.")] = 2,
        modes: Annotated[str, typer.Option(
            help="Comma-separated modes: unary or stream, :N for N groups per call "
                 "(a node sends up to 8 from its spool).")] = "unary,stream,unary:8",
        floor: Annotated[bool, typer.Option(
            help="Also measure each mode against a gRPC server that parses and acks without "
                 "checking or storing: the floor gRPC itself sets on this machine.")] = False,
    ) -> None:
        """Groups/s a real server acks (durably) from K clients, and where the CPU goes."""
        from rich.console import Console
        from rich.table import Table

        from jetctl.bench.ingest import parse_modes, run
        from jetctl.bench.serve import BenchError
        from jetctl.cli.errors import fail

        try:
            chosen = parse_modes(modes)
        except ValueError as exc:
            fail(f"--modes {modes!r}: {exc}")
        if clients < processes or processes < 1:
            fail(f"--clients ({clients}) must be at least --processes ({processes}), "
                 "which must be at least 1")
        console = Console()
        if not console.is_terminal:  # piped or logged: keep the table whole
            console = Console(width=max(console.width, 160))
        try:
            with console.status(f"starting a server and {clients} clients..."):
                out = run(clients=clients, seconds=seconds, group_bytes=group_bytes,
                          processes=processes, modes=chosen, floor=floor)
        except BenchError as exc:
            fail(str(exc))
        size = out.results[0].group_bytes
        table = Table(title=f"jetctl bench ingest: {clients} clients in {processes} processes, "
                            f"{size:,} B groups, {seconds:g} s per mode")
        for col in ("server", "mode", "groups/s", "MB/s", "p50 ack ms", "p99 ack ms",
                    "not accepted", "server cores", "server us/group", "client cores",
                    "client us/group", "vs first"):
            table.add_column(col, justify="right")
        base = out.results[0].groups_per_s
        for r in out.results:
            table.add_row(
                r.server, r.mode.name, f"{r.groups_per_s:,.0f}", f"{r.mb_per_s:.1f}", f"{r.p50_ms:.1f}",
                f"{r.p99_ms:.1f}", str(r.not_accepted), f"{r.cores(r.server_cpu_s):.2f}",
                f"{r.us_per_group(r.server_cpu_s):,.0f}", f"{r.cores(r.client_cpu_s):.2f}",
                f"{r.us_per_group(r.client_cpu_s):,.0f}", f"{r.groups_per_s / base:.2f}x",
            )
        console.print(table)
        console.print("ack latency: one call, from send to reply; cores: CPU seconds / wall "
                      "seconds of the mode; us/group: CPU microseconds per acked group"
                      + ("; floor: a gRPC server that parses and acks, nothing more" if floor
                         else ""), highlight=False)
        mark = "[green]yes[/green]" if out.nothing_lost else "[red]NO[/red]"
        console.print(f"stored == acked: {mark} ({out.stored:,} groups in the store, "
                      f"{out.acked:,} acked ACCEPTED)")
        if not out.nothing_lost:
            raise typer.Exit(1)
