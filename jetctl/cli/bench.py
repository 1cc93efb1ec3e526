"""`jetctl bench ...`: benchmarks that print side-by-side figures and ratios from one run."""

from __future__ import annotations

from typing import Annotated, get_args

import typer


def register(app: typer.Typer) -> None:
    bench = typer.Typer(help="Benchmarks: figures measured side by side in one run.",
                        no_args_is_help=True)
    app.add_typer(bench, name="bench")
    from jetctl.cli import bench_loop

    bench_loop.register(bench)

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

    @bench.command("tools")
    def tools(
        model: Annotated[str, typer.Option(help="Model source (builtin:..., folder, HF id).")] = (
            "builtin:smollm2-135m-instruct"),
        envs: Annotated[str, typer.Option(help="Comma-separated: web, code, api.")] = (
            "web,code,api"),
        levels: Annotated[str, typer.Option(help="Comma-separated levels: easy, hard.")] = (
            "easy,hard"),
        rollouts: Annotated[int, typer.Option(help="Rollouts per env and level.")] = 16,
        max_tokens: Annotated[int, typer.Option(help="Most tokens per model call.")] = 64,
        concurrency: Annotated[int, typer.Option(
            help="Rollouts at once (and the engine's batch size).")] = 8,
        seed: Annotated[int, typer.Option(help="Seed of the task streams.")] = 0,
        code_backend: Annotated[str, typer.Option(
            help="The code env's sandbox: auto, docker, bwrap or process.")] = "auto",
    ) -> None:
        """Well-formed tool calls of an untrained model, per env and level (real envs)."""
        from rich.console import Console
        from rich.table import Table

        from envs.levels import LEVELS
        from jetctl.bench.tools import run
        from jetctl.cli.errors import fail

        picked = [lv.strip() for lv in levels.split(",") if lv.strip()]
        bad = [lv for lv in picked if lv not in LEVELS]
        if bad:
            fail(f"--levels {','.join(bad)}: choose from {', '.join(LEVELS)}")
        console = Console()
        with console.status(f"{rollouts} rollouts per env and level on {model}..."):
            try:
                results = run(model, [e.strip() for e in envs.split(",") if e.strip()], picked,
                              rollouts, max_tokens, seed=seed, concurrency=concurrency,
                              env_args={"code": {"backend": code_backend}})
            except ValueError as exc:
                fail(str(exc))
        table = Table(title=f"jetctl bench tools: {model}, untrained, {max_tokens} tokens a call")
        for col in ("env", "level", "rollouts", "acted well-formed", "calls", "well-formed calls",
                    "mean reward", "failed", "s"):
            table.add_column(col, justify="left" if col in ("env", "level") else "right")
        for r in results:
            table.add_row(r.env, r.level, str(r.rollouts), f"{r.acted}/{r.rollouts} "
                          f"({r.acted_rate:.0%})", str(r.calls), f"{r.well_formed}/{r.calls}",
                          f"{r.reward:.3f}", str(r.failed), f"{r.seconds:.0f}")
        console.print(table)
        console.print("acted well-formed: rollouts with at least one tool call the env ran "
                      "(a tool the level offers, arguments of the right names)", highlight=False)
