"""`jetctl bench loop`: the swarm against a plain synchronous loop (jetctl.bench.loop)."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer


def register(bench: typer.Typer) -> None:
    @bench.command("loop")
    def loop(
        recipe: Annotated[Path, typer.Argument(help="The recipe; its first task is run.")],
        seconds: Annotated[float, typer.Option(help="Wall seconds of each run.")] = 300.0,
        env_latency: Annotated[str, typer.Option(
            help="Comma-separated seconds added to every environment answer, e.g. 0,0.5,2."
        )] = "0",
        seeds: Annotated[str, typer.Option(help="Comma-separated seeds.")] = "0",
        modes: Annotated[str, typer.Option(help="swarm,loop or one of them.")] = "loop,swarm",
        task: Annotated[str | None, typer.Option(help="The task to run (default: the first).")] = None,
        out: Annotated[Path | None, typer.Option(
            help="Folder for the runs and bench-loop.json (default: a temp folder).")] = None,
        algorithms: Annotated[str | None, typer.Option(
            help="Comma-separated train.algorithm values to compare, both sides each, e.g. "
            "grpo,dr_grpo,dapo,gspo,rloo (default: the recipe's).",
        )] = None,
        loop_dynamic_sampling: Annotated[bool, typer.Option(
            help="The loop steps only on groups_per_step groups whose rewards differ, as the "
            "swarm's trainer does (default: every round's groups are trained as they come).",
        )] = False,
        loop_groups: Annotated[int, typer.Option(
            help="Groups (prompts x G rollouts) the loop generates per round, one generate "
            "per turn over them all (default 2: the reference loop; the recipe's "
            "groups_per_step is the swarm's).", min=1,
        )] = 2,
        until: Annotated[float | None, typer.Option(
            help="Stop each run once the mean reward of its last 20 groups reaches this "
            "(the swarm drains: SIGTERM); time to that reward is still measured, later rows "
            "describe the stop (default: every run takes --seconds).",
        )] = None,
        swarm_train: Annotated[list[str] | None, typer.Option(
            help="One more swarm run per latency and seed with these train settings, "
            "space-separated key=value, e.g. 'tis_cap=2.0' or 'order=newest max_staleness=2' "
            "(a key of the model's train block, or block.key of another of its blocks: "
            "'generation.max_batch_size=32') "
            "(repeat for several; the loop runs once, and the recipe's own swarm where "
            "--modes names the swarm: --modes loop --swarm-train X runs the loop and X only).",
        )] = None,
    ) -> None:
        """The swarm (jetctl up) vs a plain loop in one process: same model, env, agent,
        sampling and optimizer; time to first step, s/step, trajectories/s, time to reward,
        trainer busy, CPU per process; ratios measured side by side."""
        from rich.console import Console

        from jetctl.bench import loop as bl
        from jetctl.cli.errors import fail

        try:
            latencies = [float(x) for x in env_latency.split(",") if x.strip()]
            seed_list = [int(x) for x in seeds.split(",") if x.strip()]
        except ValueError:
            fail(f"--env-latency {env_latency!r} / --seeds {seeds!r}: give numbers separated by commas")
        mode_list = [m.strip() for m in modes.split(",") if m.strip()]
        if not mode_list or set(mode_list) - {"swarm", "loop"}:
            fail(f"--modes {modes!r}: choose from swarm, loop")
        if any(x < 0 for x in latencies) or not latencies or not seed_list:
            fail("--env-latency needs values >= 0 and --seeds at least one seed")
        from jetctl.server import algorithms as registry

        algorithm_list = [a.strip() for a in (algorithms or "").split(",") if a.strip()] or None
        unknown = sorted(set(algorithm_list or []) - set(registry.names()))
        if unknown:
            fail(f"--algorithms {algorithms!r}: {', '.join(unknown)} unknown; choose from "
                 f"{', '.join(registry.names())}")
        if until is not None and not 0 < until <= 1:
            fail(f"--until ({until:g}) is a reward threshold in (0, 1], e.g. 0.8")
        if not recipe.is_file():
            fail(f"no recipe at {recipe}")
        variant_list = [v.strip() for v in swarm_train or [] if v.strip()]
        for v in variant_list:
            try:
                bl.check_variant(recipe, task, v)
            except ValueError as e:
                fail(f"--swarm-train {v!r}: {e}")
        if seconds < 10:
            fail(f"--seconds ({seconds:g}) must be at least 10")
        console = Console()
        if not console.is_terminal:
            console = Console(width=max(console.width, 160))
        runs = len(latencies) * len(seed_list) * len(algorithm_list or [None]) * (
            len(mode_list) + len(variant_list))
        console.print(f"{runs} runs of {seconds:g} s each (about {runs * seconds / 60:.0f} min"
                      f"{', less where a run reaches --until' if until is not None else ''})")
        results = bl.run(recipe, seconds=seconds, latencies=latencies, seeds=seed_list,
                         modes=mode_list, task=task, out_dir=out,
                         loop_dynamic_sampling=loop_dynamic_sampling, algorithms=algorithm_list,
                         loop_groups=loop_groups, until=until, variants=variant_list,
                         progress=lambda msg: console.print(f"[dim]running {msg}[/dim]"))
        console.print(bl.render(results))
