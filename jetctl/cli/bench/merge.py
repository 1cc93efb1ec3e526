"""`jetctl bench merge`: naive vs linear vs tree merging of a batch (jetctl.bench.merge)."""

from __future__ import annotations

from typing import Annotated, get_args

import typer


def register(bench: typer.Typer) -> None:
    @bench.command("merge")
    def merge(
        model: Annotated[str, typer.Option(help="Model source (builtin:..., folder, HF id).")] = (
            "builtin:smollm2-135m-instruct"),
        workloads: Annotated[str, typer.Option(
            help="Comma-separated: 1 tool agent 4 turns, 2 agent 12 turns, "
                 "3 GRPO G=8 1k prompt, 4 three agents 2k document.")] = "1,2,3,4",
        repeats: Annotated[int, typer.Option(help="Timed steps per cell (median).")] = 1,
        quick: Annotated[bool, typer.Option(help="Small workloads (tests, smoke runs).")] = False,
        finetune: Annotated[str, typer.Option(help="lora (the recipe default) or full.")] = "lora",
        attn: Annotated[str, typer.Option(
            help="Attention kernel: jetctl_tree (the server's: sdpa, and only the visible "
                 "scores of tree-packed rows), sdpa or eager.")] = "jetctl_tree",
        max_tokens_per_microbatch: Annotated[int | None, typer.Option(
            help="Micro-batch token budget (default: the recipe's).")] = None,
        json_out: Annotated[str | None, typer.Option(
            "--json", help="Also write the figures and ratios to this JSON file.")] = None,
    ) -> None:
        """Naive vs linear vs tree merging: tokens, forward+backward seconds, peak memory."""
        import json
        from pathlib import Path

        from rich.console import Console
        from rich.progress import (
            BarColumn,
            MofNCompleteColumn,
            Progress,
            SpinnerColumn,
            TextColumn,
            TimeElapsedColumn,
        )
        from rich.table import Table

        from jetctl.bench import merge as bm
        from jetctl.cli.errors import fail
        from jetctl.models import ModelSourceError, load_tokenizer
        from jetctl.recipe import TrainConfig

        try:
            numbers = [int(x) for x in workloads.split(",") if x.strip()]
        except ValueError:
            fail(f"--workloads {workloads!r}: give numbers from 1-4 separated by commas")
        bad = sorted(set(numbers) - set(bm.WORKLOAD_NAMES))
        if bad or not numbers:
            fail(f"--workloads {workloads!r}: unknown {bad}; choose from 1, 2, 3, 4")
        if repeats < 1:
            fail(f"--repeats ({repeats}) must be at least 1")
        if finetune not in ("lora", "full"):
            fail(f"--finetune {finetune!r}: choose lora or full")
        if attn not in get_args(bm.Attention):
            fail(f"--attn {attn!r}: choose {', '.join(get_args(bm.Attention))}")
        train = TrainConfig()
        budget = max_tokens_per_microbatch or train.max_tokens_per_microbatch
        if budget < 1:
            fail(f"--max-tokens-per-microbatch ({budget}) must be at least 1")
        opts = bm.RunOptions(model=model, finetune=finetune, attn=attn,  # type: ignore[arg-type]
                             max_tokens_per_microbatch=budget, clip_eps=train.clip_eps,
                             repeats=repeats)
        console = Console()
        if not console.is_terminal:  # piped or logged: keep the wide table whole
            console = Console(width=max(console.width, 200))
        try:
            with console.status(f"rendering workloads with the {model} tokenizer..."):
                tokenizer = load_tokenizer(model)
                built = bm.build_workloads(tokenizer, numbers, quick=quick)
        except ModelSourceError as exc:
            fail(str(exc))

        with Progress(SpinnerColumn(), TextColumn("{task.description}"), BarColumn(),
                      MofNCompleteColumn(), TimeElapsedColumn(), console=console,
                      transient=True) as progress:
            task = progress.add_task("", total=len(built) * len(bm.MODES))

            def on_start(w: bm.Workload, mode: str) -> None:
                progress.update(task, description=f"workload {w.number} ({w.name}): {mode}")

            def on_done(r: bm.ModeResult) -> None:
                progress.advance(task)
                same = f" (same micro-batches as {r.same_as}: not re-run)" if r.same_as else ""
                console.print(f"  workload {r.workload} {r.mode:>6}: {r.tokens_fed:,} tokens, "
                              f"{r.step_s:.2f} s, peak {r.peak_rss_mib:,.0f} MiB{same}",
                              highlight=False)

            try:
                results = bm.run(built, opts, on_start=on_start, on_done=on_done)
            except bm.BenchError as exc:
                fail(str(exc))

        rs = bm.ratios(results)
        table = Table(title=f"jetctl bench merge: {model}, {finetune}, {attn}, fp32, "
                            f"{budget} tokens/micro-batch, median of {repeats}")
        for col in ("workload", "mode", "tokens", "padded", "mb", "fwd s", "bwd s",
                    "fwd+bwd s", "peak MiB", "step MiB", "tokens x", "time x", "peak x"):
            table.add_column(col, justify="left" if col in ("workload", "mode") else "right")
        for r in results:
            x = rs[(r.workload, r.mode)]
            table.add_row(
                f"{r.workload} {bm.WORKLOAD_NAMES[r.workload]}" if r.mode == "off" else "",
                r.mode + (f" (= {r.same_as})" if r.same_as else ""),
                f"{r.tokens_fed:,}", f"{r.tokens_padded:,}", str(r.microbatches),
                f"{r.forward_s:.2f}", f"{r.backward_s:.2f}", f"{r.step_s:.2f}",
                f"{r.peak_rss_mib:,.0f}", f"{r.step_mib:,.0f}", f"{x.tokens:.2f}x",
                f"{x.time:.2f}x", f"{x.memory:.2f}x",
                end_section=r.mode == bm.MODES[-1],
            )
        console.print(table)
        console.print(f"peak MiB: {results[0].peak_method} of the worker process over the "
                      "measured steps (model resident); step MiB: peak minus the RSS before "
                      "the steps; x: naive / mode (higher is better)", highlight=False)
        for t in bm.targets(results):
            mark = "[green]met[/green]" if t.met else "[red]missed[/red]"
            console.print(f"target workload {t.workload} {t.what}: {t.reached:.2f}x "
                          f"(goal >= {t.goal:g}x) {mark}")
        if json_out:
            Path(json_out).write_text(json.dumps(bm.to_json(results, opts), indent=2))
