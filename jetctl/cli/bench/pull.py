"""`jetctl bench pull`: PullWeights MB/s on loopback, full weights and LoRA (jetctl.bench.pull)."""

from __future__ import annotations

from typing import Annotated

import typer


def register(bench: typer.Typer) -> None:
    @bench.command("pull")
    def pull(
        model: Annotated[str, typer.Option(help="Model source (builtin:..., folder, HF id).")] = (
            "builtin:smollm2-135m-instruct"),
        kinds: Annotated[str, typer.Option(help="Comma-separated: full, lora.")] = "full,lora",
        repeats: Annotated[int, typer.Option(help="Warm pulls per kind (median).")] = 3,
        floor: Annotated[bool, typer.Option(
            help="Also pull the same bytes from a bare gRPC server with a bare gRPC client "
                 "(no checks, no hash): what gRPC alone moves on this machine.")] = False,
    ) -> None:
        """PullWeights MB/s on loopback: full weights and a LoRA adapter, cold and warm."""
        from rich.console import Console
        from rich.table import Table

        from jetctl.bench import pull as bp
        from jetctl.bench.serve import BenchError
        from jetctl.cli.errors import fail

        chosen = tuple(k.strip() for k in kinds.split(",") if k.strip())
        unknown = sorted(set(chosen) - set(bp.KINDS))
        if unknown or not chosen:
            fail(f"--kinds {kinds!r}: unknown {unknown}; choose from {', '.join(bp.KINDS)}")
        if repeats < 0:
            fail(f"--repeats ({repeats}) must be 0 or more")
        console = Console()
        if not console.is_terminal:
            console = Console(width=max(console.width, 140))
        try:
            with console.status("starting a server...") as status:
                results = bp.run(model, chosen, repeats, floor=floor,
                                 on_kind=lambda k: status.update(
                    f"{k}: starting a server with finetune {k} and pulling its weights..."))
        except BenchError as exc:
            fail(str(exc))
        table = Table(title=f"jetctl bench pull: {model}, loopback, plaintext")
        for col in ("kind", "pull", "MB", "seconds", "MB/s", "server CPU s", "client CPU s",
                    "buffer reused", "vs floor"):
            table.add_column(col, justify="right")
        floors = {r.kind: r.mb_per_s for r in results if r.phase == "floor"}
        for r in results:
            vs = f"{r.mb_per_s / floors[r.kind]:.2f}x" if r.kind in floors else ""
            table.add_row(r.kind, f"{r.phase}" + (f" (median of {r.pulls})" if r.pulls > 1 else ""),
                          f"{r.bytes / 1e6:,.1f}", f"{r.seconds:.3f}", f"{r.mb_per_s:,.0f}",
                          f"{r.server_cpu_s:.2f}", f"{r.client_cpu_s:.2f}",
                          "" if r.phase == "floor" else f"{r.reused}/{r.pulls}", vs)
        console.print(table)
        console.print("cold: the first pull of a version (the server serializes and hashes it "
                      "once); warm: later pulls of the same version, into a new payload buffer "
                      "(its pages faulted in as chunks land) or as a node pulls every version, "
                      "into the previous pull's buffer once nothing views it. The client is "
                      "SwarmTransport.pull_weights: chunks written into one buffer, size and "
                      "sha256 checked."
                      + (" floor: the same bytes in the same frames, bare gRPC server to bare "
                         "gRPC client (no checks, no hash, no copy)." if floor else ""),
                      highlight=False)
