"""`jetctl bench tools`: well-formed tool calls of an untrained model (jetctl.bench.tools)."""

from __future__ import annotations

from typing import Annotated

import typer


def register(bench: typer.Typer) -> None:
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
