"""`jetctl bench soak`: N groups through one real server, figures per window (jetctl.bench.soak)."""

from __future__ import annotations

import json
from typing import Annotated

import typer


def register(bench: typer.Typer) -> None:
    @bench.command("soak")
    def soak(
        groups: Annotated[int, typer.Option(help="Groups to push through the server.")] = 1_000_000,
        window: Annotated[int, typer.Option(help=(
            "Groups per window of figures (the first ends at 10,000 when this is larger)."))] = 100_000,
        group_bytes: Annotated[int, typer.Option(help="Approximate bytes per group.")] = 1024,
        as_json: Annotated[bool, typer.Option("--json", help="Print one JSON object.")] = False,
    ) -> None:
        """Submit p50/p99, Status latency, server RSS, store and spool bytes per window of
        groups, from a node's spool through one server with training on."""
        from rich.console import Console
        from rich.table import Table

        from jetctl.bench.serve import BenchError
        from jetctl.bench.soak import run
        from jetctl.cli.errors import fail

        if groups < 1 or window < 1:
            fail(f"--groups ({groups}) and --window ({window}) must be at least 1")
        try:
            out = run(groups=groups, window=window, group_bytes=group_bytes)
        except BenchError as exc:
            fail(str(exc))
        if as_json:
            print(json.dumps(out.to_json()))
        else:
            table = Table(title=f"jetctl bench soak: {groups:,} groups of {out.group_bytes:,} B "
                                f"in {out.seconds:.0f} s")
            for col in ("groups", "submit p50 ms", "submit p99 ms", "status ms",
                        "server RSS MiB", "store bytes", "spool bytes", "trained"):
                table.add_column(col, justify="right")
            for w in out.windows:
                table.add_row(f"{w.groups:,}", f"{w.submit_p50_ms:.1f}", f"{w.submit_p99_ms:.1f}",
                              f"{w.status_ms:.1f}", f"{w.server_rss_mib:.0f}",
                              f"{w.store_bytes:,}", f"{w.spool_bytes:,}",
                              f"{w.trained_groups:,}")
            Console().print(table)
            for what, ratio, bound, met in out.goals():
                print(f"{'met   ' if met else 'MISSED'} {what}: {ratio:.2f}x (goal <= {bound}x)")
            print(f"acked {out.acked:,}, stored {out.stored:,}: "
                  + ("nothing lost" if out.nothing_lost else "LOST GROUPS"))
        if not out.nothing_lost:
            raise typer.Exit(1)
