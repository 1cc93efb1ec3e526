"""`jetctl bench scale`: many client nodes against one server (jetctl.bench.scale)."""

from __future__ import annotations

from typing import Annotated

import typer


def register(bench: typer.Typer) -> None:
    @bench.command("scale")
    def scale(
        nodes: Annotated[int, typer.Option(help="Client nodes (scripted agent).")] = 200,
        hosts: Annotated[int, typer.Option(help="Processes (or Ray actors) the nodes share.")] = 4,
        seconds: Annotated[float, typer.Option(help="Measured seconds, after the warm-up.")] = 60.0,
        interval: Annotated[float, typer.Option(help="Seconds between a node's groups.")] = 2.0,
        warmup: Annotated[float, typer.Option(help="Seconds before measuring.")] = 20.0,
        ray: Annotated[str | None, typer.Option(
            "--ray", help="A Ray cluster's address: node hosts and the server as actors.")] = None,
        json_out: Annotated[str | None, typer.Option(
            "--json", help="Also write the figures to this JSON file.")] = None,
    ) -> None:
        """Many client nodes against one server through a real controller: groups/s, ack
        latency, server and controller RSS/CPU, Status latency."""
        import json
        from pathlib import Path

        from rich.console import Console
        from rich.table import Table

        from jetctl.bench.scale import result_json, run

        console = Console()
        r = run(nodes=nodes, hosts=hosts, seconds=seconds, interval=interval,
                ray_address=ray, warmup_s=warmup, say=lambda m: console.print(f"[dim]{m}[/dim]"))
        table = Table(title=f"jetctl bench scale: {r.nodes} nodes in {r.hosts} "
                      f"{'Ray actors' if r.mode == 'ray' else 'processes'}, a group of 4 every "
                      f"{interval:g}s per node")
        rows = [
            ("nodes running", f"{r.nodes_running}"),
            ("groups/s accepted", f"{r.groups_per_s:,.1f} (offered {r.nodes / interval:,.1f})"),
            ("Submit ack p50 / p99", f"{r.ack_p50_ms:.0f} / {r.ack_p99_ms:.0f} ms"),
            ("server RSS / CPU", f"{r.server_rss_mb:,.0f} MB / {r.server_cpu_pct:.0f}%"),
            ("controller RSS / CPU",
             f"{r.controller_rss_mb:,.0f} MB / {r.controller_cpu_pct:.0f}%"),
            ("Status p50 / p99", f"{r.status_p50_ms:.0f} / {r.status_p99_ms:.0f} ms"),
            ("ledger", "balanced" if r.ledger_balanced else f"NOT balanced: {r.ledger}"),
        ]
        table.add_column("figure")
        table.add_column(r.mode, justify="right")
        for row in rows:
            table.add_row(*row)
        console.print(table)
        if json_out:
            Path(json_out).write_text(json.dumps(result_json(r), indent=1) + "\n")
