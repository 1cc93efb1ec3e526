"""The cost ledger of a model's training: what its steps cost, summed from its step log.

    costs = read_costs(RunPaths(run_dir).steps_log("policy"))
    costs.cpu_s_per_reward_step   # server CPU seconds per 0.1 of reward gained

Each step row (jetctl/server/trainer.py) carries `cost/server_cpu_s` (the server process's
CPU seconds since the previous row), split into `cost/train_cpu_s` (the trainer thread's, in
the step), `cost/publish_cpu_s` (publishing the new weights) and `cost/generate_cpu_s` (the
rest: generation above all, with admission, gRPC and gathering), and `tokens/generated`,
`tokens/trained` (completion tokens of the groups the step consumed, and of those it trained
on), per task in `cost/tokens_by_task`. A task's CPU seconds are the server's apportioned by
its share of the generated tokens.

The run's summary (`jetctl status` on a finished run, the end of `jetctl up`) shows one line
per model. Left out (planned, issue 28): GPU seconds, client CPU seconds and env wall time
(they live on the client nodes), spend an env reports, the live `jetctl status` tables (its
server figures come over a protocol this ledger does not change), trackers and bench outputs.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

REWARD_WINDOW = 10  # steps: the reward gained is the mean of the last this many minus the first
REWARD_STEP = 0.1  # the unit of reward gained the summary prices


@dataclass(frozen=True)
class TaskCost:
    generated_tokens: int
    trained_tokens: int
    cpu_s: float  # the server's CPU seconds apportioned by generated tokens


@dataclass(frozen=True)
class Costs:
    steps: int
    server_cpu_s: float
    train_cpu_s: float
    generate_cpu_s: float
    publish_cpu_s: float
    tokens_generated: int
    tokens_trained: int
    reward_gain: float | None  # mean reward of the last REWARD_WINDOW steps minus the first
    tasks: dict[str, TaskCost] = field(default_factory=dict)

    @property
    def cpu_s_per_reward_step(self) -> float | None:
        """Server CPU seconds per REWARD_STEP of reward gained (None: no gain to price)."""
        if self.reward_gain is None or self.reward_gain <= 0:
            return None
        return self.server_cpu_s / (self.reward_gain / REWARD_STEP)

    def to_json(self) -> dict[str, Any]:
        return {
            "steps": self.steps, "server_cpu_s": self.server_cpu_s,
            "train_cpu_s": self.train_cpu_s, "generate_cpu_s": self.generate_cpu_s,
            "publish_cpu_s": self.publish_cpu_s, "tokens_generated": self.tokens_generated,
            "tokens_trained": self.tokens_trained, "reward_gain": self.reward_gain,
            "cpu_s_per_0.1_reward": self.cpu_s_per_reward_step,
            "tasks": {t: vars(c) for t, c in self.tasks.items()},
        }


def read_costs(steps_log: Path) -> Costs | None:
    """The ledger of a step log; None when no row carries cost figures."""
    rows: list[dict[str, Any]] = []
    if steps_log.is_file():
        for line in steps_log.read_text().splitlines():
            try:
                row = json.loads(line)
            except ValueError:
                continue  # a line cut short by a kill
            if "cost/server_cpu_s" in row:
                rows.append(row)
    if not rows:
        return None
    server = sum(r["cost/server_cpu_s"] for r in rows)
    by_task: dict[str, list[int]] = {}
    for r in rows:
        for task, (gen, trained) in r["cost/tokens_by_task"].items():
            acc = by_task.setdefault(task, [0, 0])
            acc[0] += gen
            acc[1] += trained
    generated = sum(g for g, _ in by_task.values())
    rewards = [float(r["reward/mean"]) for r in rows]
    window = min(REWARD_WINDOW, len(rewards) // 2)
    gain = (sum(rewards[-window:]) - sum(rewards[:window])) / window if window else None
    return Costs(
        steps=len(rows),
        server_cpu_s=server,
        train_cpu_s=sum(r["cost/train_cpu_s"] for r in rows),
        generate_cpu_s=sum(r["cost/generate_cpu_s"] for r in rows),
        publish_cpu_s=sum(r["cost/publish_cpu_s"] for r in rows),
        tokens_generated=generated,
        tokens_trained=sum(t for _, t in by_task.values()),
        reward_gain=gain,
        tasks={t: TaskCost(g, tr, server * g / generated if generated else 0.0)
               for t, (g, tr) in sorted(by_task.items())},
    )


def cost_line(model: str, costs: dict[str, Any]) -> str:
    """One summary line of a model's ledger (`Costs.to_json()`)."""
    per = costs["cpu_s_per_0.1_reward"]
    tasks = ", ".join(f"{t} {c['cpu_s']:.1f} s" for t, c in costs["tasks"].items())
    return (
        f"cost {model}: server CPU {costs['server_cpu_s']:.1f} s (train "
        f"{costs['train_cpu_s']:.1f}, generate {costs['generate_cpu_s']:.1f}, publish "
        f"{costs['publish_cpu_s']:.1f}) over {costs['steps']} steps; tokens generated "
        f"{costs['tokens_generated']}, trained {costs['tokens_trained']}; per task: {tasks}; "
        + (f"{per:.1f} CPU s per 0.1 of reward gained" if per is not None
           else "no reward gained to price")
    )
