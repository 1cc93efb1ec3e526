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

Outside the server, each trajectory carries its share of its rollout's cost
(`Trajectory.costs`, made on the client by `rollout_costs`): `usd/<kind>` (spend the env
reported through `jetctl.env.Spending.cost`), `client_cpu_s` (the rollout process's CPU
seconds, with the children it waited for) and `env_s` (wall seconds in the env's `open`
and `reward`); a team rollout's cost is split evenly over its roles. The step row sums them
over the groups the step consumed (`step_client_costs`): `cost/usd` (all kinds),
`cost/usd/<kind>`, `cost/client_cpu_s`, `cost/env_s`, and per task in the log only
`cost/client_by_task`. The trackers get every scalar of the row (jetctl/trackers.py).

Waste: spend that trained nothing. A client node tallies in its status (`waste`: `NodeWaste`,
`add_waste`) its task's trajectories that never trained: those that never reached a group it
spooled (failed, timed out, or ok in a group dropped for having fewer than 2 ok),
those of a group whose node task raised (what its rollouts reported before the group was
lost), those of a group the server refused at Submit (acks STALE, INVALID, REVISION: their
costs read from the group's spooled bytes) or too large to send (dead-letter), and, by
number only, those a killed predecessor of the node lost mid-rollout. Each counts its
`Trajectory.costs` with `trajectories` (how many) and `rollout_s` (its share of its rollout's
wall seconds). A rollout's process reports its spend as it happens (each `session.cost`,
with its env timings so far, one small message to the node: jetctl/client/rollout.py), so a
rollout killed for its timeout, or one that died without a result, keeps the spend it
reported and its env seconds; its CPU seconds stay unknown. A failed rollout's spend counts
too. The tally lives in the node's spool (its `waste` table, jetctl/client/spool.py) and is
read back when the node starts, so a node restarted under the same name goes on from its
predecessor's tally. Where the spool itself records the end of trajectories (a refused ack,
a dead letter, rollouts a killed predecessor lost) their waste is added in that same
transaction, so a node killed in between cannot record one without the other; a failed or
dropped rollout's waste is added right after its `dropped` row, in a second transaction. The controller keeps each node's
last status in `nodes/<name>.json`; `client_waste` sums them per task. The server adds the
groups its batch-time staleness gate refused (they reached it, were never trained) to its
next step row as `cost/waste_by_task` (the same keys but `rollout_s`: a trajectory does not
say over how many roles its rollout's wall time is split), summed into `Costs.waste`.

GPU seconds: where the trainer's model is on a CUDA device, each row also carries
`cost/train_gpu_s` (wall seconds of the step, synchronized with the device),
`cost/publish_gpu_s` (of publishing) and `cost/generate_gpu_s` (the rest of the row's wall
interval: generation, and the time the device sat held but idle, since a held accelerator is
paid for by the second) (`gpu_split`). On a CPU they are absent, not 0, and `Costs`' GPU
figures are None.

The run's summary (`jetctl status` on a finished run, the end of `jetctl up`) and the live
`jetctl status` (the step logs of the servers on this host) show one line per model, with the
server CPU seconds and, where an env reported spend, the dollars per 0.1 of reward gained,
and one line of waste per task; `jetctl bench loop` prints `Costs.per_step()` of the swarm
(with the waste its rows carry, the groups refused stale at batch time, and on a GPU its GPU
seconds; the nodes' waste is in their statuses and the run's summary).
Left out (planned, issue 28): the env's time inside the agent's tool calls (only its `open`
and `reward` are timed); the CPU seconds of a rollout killed for its timeout; a server on
another host in the live view (its step log stays there).
"""

from __future__ import annotations

import json
import logging
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol

log = logging.getLogger(__name__)

REWARD_WINDOW = 10  # steps: the reward gained is the mean of the last this many minus the first
REWARD_STEP = 0.1  # the unit of reward gained the summary prices
USD = "usd/"  # a Trajectory.costs key of spend: usd/<kind>
CLIENT_CPU_S, ENV_S = "client_cpu_s", "env_s"  # the other Trajectory.costs keys
WASTED, ROLLOUT_S = "trajectories", "rollout_s"  # a waste tally's count and wall seconds
GPU_KEYS = ("cost/train_gpu_s", "cost/generate_gpu_s", "cost/publish_gpu_s")


def rollout_costs(timings: Mapping[str, float], usd: Mapping[str, float],
                  roles: int = 1) -> dict[str, float]:
    """A trajectory's `costs`: its share (1/roles: a team rollout's roles split it) of its
    rollout's reported spend (kind -> USD), CPU seconds and env wall seconds."""
    share = 1.0 / roles
    out = {USD + kind: v * share for kind, v in sorted(usd.items())}
    if "cpu_s" in timings:
        out[CLIENT_CPU_S] = timings["cpu_s"] * share
    env = [timings[k] for k in ("open_s", "reward_s") if k in timings]
    if env:
        out[ENV_S] = sum(env) * share
    return out


def step_client_costs(consumed: Iterable[tuple[str, Mapping[str, float]]],
                      ) -> tuple[dict[str, float], dict[str, dict[str, float]]]:
    """The step row's client-side figures from (task, trajectory costs) of every trajectory
    the step consumed: its scalars (`cost/usd`, `cost/usd/<kind>`, `cost/client_cpu_s`,
    `cost/env_s`, always present) and task -> summed costs (`cost/client_by_task`)."""
    by_task: dict[str, dict[str, float]] = {}
    for task, costs in consumed:
        acc = by_task.setdefault(task, {})
        for k, v in costs.items():
            acc[k] = acc.get(k, 0.0) + v
    total: dict[str, float] = {}
    for acc in by_task.values():
        for k, v in acc.items():
            total[k] = total.get(k, 0.0) + v
    usd = {k: v for k, v in total.items() if k.startswith(USD)}
    scalars = {"cost/usd": sum(usd.values()),
               "cost/client_cpu_s": total.get(CLIENT_CPU_S, 0.0),
               "cost/env_s": total.get(ENV_S, 0.0)}
    scalars.update({f"cost/{k}": v for k, v in sorted(usd.items())})
    return scalars, {t: dict(sorted(c.items())) for t, c in sorted(by_task.items())}


def add_waste(tally: dict[str, float], costs: Mapping[str, float],
              rollout_s: float | None = None) -> None:
    """Add one trajectory that trained nothing to a waste tally: its costs, 1 to
    `trajectories` and (where known) its share of its rollout's wall seconds to `rollout_s`."""
    for k, v in costs.items():
        tally[k] = tally.get(k, 0.0) + v
    tally[WASTED] = tally.get(WASTED, 0.0) + 1
    if rollout_s is not None:
        tally[ROLLOUT_S] = tally.get(ROLLOUT_S, 0.0) + rollout_s


class WasteStore(Protocol):
    """Where a node's waste tally is kept: its spool (jetctl/client/spool.py `Spool`)."""

    def waste(self) -> dict[str, float]: ...

    def add_waste(self, tally: Mapping[str, float]) -> None: ...


class NodeWaste:
    """A client node's waste tally (`add_waste`'s keys), kept in its spool (`store`; None: in
    memory only) and read back when the node starts again under the same name: the
    controller keeps only a node's last status, so a tally that started again would forget
    its predecessor's waste. `roles`: a team rollout's wall seconds are split evenly over its
    roles' trajectories."""

    def __init__(self, store: WasteStore | None = None, roles: int = 1) -> None:
        self.store = store
        self.roles = roles
        self.totals: dict[str, float] = dict(store.waste()) if store is not None else {}

    def tally(
        self, trajectories: Iterable[tuple[Mapping[str, float], float | None]]
    ) -> tuple[dict[str, float], int]:
        """The tally of trajectories that trained nothing, each as (its `Trajectory.costs`,
        its rollout's wall seconds or None where unknown), and how many, without adding it:
        for a spool write that adds it in its own transaction (then `recorded`)."""
        delta: dict[str, float] = {}
        n = 0
        for costs, rollout_s in trajectories:
            add_waste(delta, costs, None if rollout_s is None else rollout_s / self.roles)
            n += 1
        return delta, n

    def add(self, trajectories: Iterable[tuple[Mapping[str, float], float | None]]) -> int:
        """Add trajectories that trained nothing (see `tally`) and keep them in the store, in
        one transaction; returns how many."""
        delta, n = self.tally(trajectories)
        if n:
            if self.store is not None:
                self.store.add_waste(delta)
            self.recorded(delta)
        return n

    def recorded(self, delta: Mapping[str, float]) -> None:
        """Add to the totals a tally the store already holds (written with the spool write
        that ended its trajectories)."""
        for k, v in delta.items():
            self.totals[k] = self.totals.get(k, 0.0) + v


def client_waste(statuses: Iterable[Mapping[str, Any]]) -> dict[str, dict[str, float]]:
    """task -> the waste tallies (`waste`) of client node statuses, summed."""
    out: dict[str, dict[str, float]] = {}
    for status in statuses:
        tally = status.get("waste") or {}
        if not tally:
            continue
        acc = out.setdefault(str(status.get("task")), {})
        for k, v in tally.items():
            acc[k] = acc.get(k, 0.0) + float(v)
    return {t: dict(sorted(c.items())) for t, c in sorted(out.items())}


def read_node_waste(nodes_dir: Path) -> dict[str, dict[str, float]]:
    """`client_waste` of the node statuses the controller kept (`nodes/<name>.json`)."""
    statuses = []
    for path in sorted(nodes_dir.glob("*.json")) if nodes_dir.is_dir() else []:
        try:
            statuses.append(json.loads(path.read_text()))
        except ValueError:
            continue  # written atomically; a foreign file is not a node's
    return client_waste(s for s in statuses if isinstance(s, dict))


def waste_line(task: str, tally: Mapping[str, float]) -> str:
    """One summary line of a task's waste tally."""
    usd = {k.removeprefix(USD): v for k, v in tally.items() if k.startswith(USD)}
    spend = (f"; env spend ${sum(usd.values()):.4f} ("
             + ", ".join(f"{k} ${v:.4f}" for k, v in sorted(usd.items())) + ")") if usd else ""
    return (f"waste {task}: {int(tally.get(WASTED, 0))} trajectories failed, timed out or "
            "dropped on the nodes, or refused at Submit: client CPU "
            f"{tally.get(CLIENT_CPU_S, 0.0):.1f} s, env {tally.get(ENV_S, 0.0):.1f} s, "
            f"rollouts {tally.get(ROLLOUT_S, 0.0):.1f} s wall" + spend)


def gpu_split(interval_s: float, train_s: float, publish_s: float) -> dict[str, float]:
    """A step row's GPU seconds (the server's model on a CUDA device): the step's and the
    publish's synchronized wall seconds, and the rest of the row's wall interval as generate."""
    return {"cost/train_gpu_s": train_s, "cost/publish_gpu_s": publish_s,
            "cost/generate_gpu_s": max(0.0, interval_s - train_s - publish_s)}


@dataclass(frozen=True)
class TaskCost:
    generated_tokens: int
    trained_tokens: int
    cpu_s: float  # the server's CPU seconds apportioned by generated tokens
    usd: float = 0.0  # spend its env reported, all kinds
    client_cpu_s: float = 0.0
    env_s: float = 0.0


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
    usd: float = 0.0  # spend the envs reported
    usd_by_kind: dict[str, float] = field(default_factory=dict)
    client_cpu_s: float = 0.0
    env_s: float = 0.0
    waste: dict[str, float] = field(default_factory=dict)  # stale at batch (add_waste keys)
    train_gpu_s: float | None = None  # None: no row on a GPU
    generate_gpu_s: float | None = None
    publish_gpu_s: float | None = None

    @property
    def cpu_s_per_reward_step(self) -> float | None:
        """Server CPU seconds per REWARD_STEP of reward gained (None: no gain to price)."""
        if self.reward_gain is None or self.reward_gain <= 0:
            return None
        return self.server_cpu_s / (self.reward_gain / REWARD_STEP)

    @property
    def usd_per_reward_step(self) -> float | None:
        """Reported dollars per REWARD_STEP of reward gained (None: no gain, or no spend)."""
        if self.reward_gain is None or self.reward_gain <= 0 or self.usd <= 0:
            return None
        return self.usd / (self.reward_gain / REWARD_STEP)

    def per_step(self) -> dict[str, float | None]:
        """The figures `jetctl bench loop` prints beside its ratios: server CPU seconds per
        step row, split; reported dollars, client CPU and tokens per step row; the prices of
        0.1 of reward gained; the waste the rows carry (groups refused stale at batch time:
        trajectories, their client CPU and spend) per step row; and where the rows were on a
        GPU, its seconds per step row, split (absent on a CPU)."""
        n = self.steps
        waste_usd = sum(v for k, v in self.waste.items() if k.startswith(USD))
        gpu = {f"{part}_gpu_s_per_step": s / n for part, s in (
            ("train", self.train_gpu_s), ("generate", self.generate_gpu_s),
            ("publish", self.publish_gpu_s)) if s is not None}
        return {
            "server_cpu_s_per_step": self.server_cpu_s / n,
            "train_cpu_s_per_step": self.train_cpu_s / n,
            "generate_cpu_s_per_step": self.generate_cpu_s / n,
            "publish_cpu_s_per_step": self.publish_cpu_s / n,
            "client_cpu_s_per_step": self.client_cpu_s / n,
            "usd_per_step": self.usd / n,
            "tokens_generated_per_step": self.tokens_generated / n,
            "cpu_s_per_0.1_reward": self.cpu_s_per_reward_step,
            "usd_per_0.1_reward": self.usd_per_reward_step,
            "waste_trajectories_per_step": self.waste.get(WASTED, 0.0) / n,
            "waste_client_cpu_s_per_step": self.waste.get(CLIENT_CPU_S, 0.0) / n,
            "waste_usd_per_step": waste_usd / n,
            **gpu,
        }

    def to_json(self) -> dict[str, Any]:
        return {
            "steps": self.steps, "server_cpu_s": self.server_cpu_s,
            "train_cpu_s": self.train_cpu_s, "generate_cpu_s": self.generate_cpu_s,
            "publish_cpu_s": self.publish_cpu_s, "tokens_generated": self.tokens_generated,
            "tokens_trained": self.tokens_trained, "reward_gain": self.reward_gain,
            "cpu_s_per_0.1_reward": self.cpu_s_per_reward_step,
            "usd": self.usd, "usd_by_kind": self.usd_by_kind,
            "client_cpu_s": self.client_cpu_s, "env_s": self.env_s,
            "usd_per_0.1_reward": self.usd_per_reward_step,
            "tasks": {t: vars(c) for t, c in self.tasks.items()},
            "waste": self.waste, "train_gpu_s": self.train_gpu_s,
            "generate_gpu_s": self.generate_gpu_s, "publish_gpu_s": self.publish_gpu_s,
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
    client: dict[str, dict[str, float]] = {}  # task -> summed Trajectory.costs
    for r in rows:
        for task, costs in r.get("cost/client_by_task", {}).items():  # rows before it had none
            spend = client.setdefault(task, {})
            for k, v in costs.items():
                spend[k] = spend.get(k, 0.0) + v
    kinds: dict[str, float] = {}
    for costs in client.values():
        for k, v in costs.items():
            if k.startswith(USD):
                kinds[k.removeprefix(USD)] = kinds.get(k.removeprefix(USD), 0.0) + v
    waste: dict[str, float] = {}
    for r in rows:
        for costs in r.get("cost/waste_by_task", {}).values():
            for k, v in costs.items():
                waste[k] = waste.get(k, 0.0) + v
    gpu = {k: sum(r[k] for r in rows if k in r) if any(k in r for r in rows) else None
           for k in GPU_KEYS}
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
        tasks={t: _task_cost(g, tr, server * g / generated if generated else 0.0,
                             client.get(t, {}))
               for t, (g, tr) in sorted(by_task.items())},
        usd=sum(kinds.values()),
        usd_by_kind=dict(sorted(kinds.items())),
        client_cpu_s=sum(c.get(CLIENT_CPU_S, 0.0) for c in client.values()),
        env_s=sum(c.get(ENV_S, 0.0) for c in client.values()),
        waste=dict(sorted(waste.items())),
        train_gpu_s=gpu["cost/train_gpu_s"], generate_gpu_s=gpu["cost/generate_gpu_s"],
        publish_gpu_s=gpu["cost/publish_gpu_s"],
    )


def _task_cost(generated: int, trained: int, cpu_s: float,
               client: Mapping[str, float]) -> TaskCost:
    return TaskCost(
        generated, trained, cpu_s,
        usd=sum(v for k, v in client.items() if k.startswith(USD)),
        client_cpu_s=client.get(CLIENT_CPU_S, 0.0), env_s=client.get(ENV_S, 0.0),
    )


def cost_line(model: str, costs: dict[str, Any]) -> str:
    """One summary line of a model's ledger (`Costs.to_json()`)."""
    per, usd_per = costs["cpu_s_per_0.1_reward"], costs["usd_per_0.1_reward"]
    spend = costs["usd"] > 0
    tasks = ", ".join(f"{t} {c['cpu_s']:.1f} s" + (f" ${c['usd']:.4f}" if spend else "")
                      for t, c in costs["tasks"].items())
    kinds = ", ".join(f"{k} ${v:.4f}" for k, v in costs["usd_by_kind"].items())
    waste = costs.get("waste") or {}  # a ledger written before waste had none
    waste_usd = sum(v for k, v in waste.items() if k.startswith(USD))
    return (
        f"cost {model}: server CPU {costs['server_cpu_s']:.1f} s (train "
        f"{costs['train_cpu_s']:.1f}, generate {costs['generate_cpu_s']:.1f}, publish "
        f"{costs['publish_cpu_s']:.1f}) over {costs['steps']} steps; "
        + (f"GPU {costs['train_gpu_s']:.1f} s train, {costs['generate_gpu_s']:.1f} generate, "
           f"{costs['publish_gpu_s']:.1f} publish; " if costs.get("train_gpu_s") is not None
           else "")
        + f"client CPU {costs['client_cpu_s']:.1f} s, env {costs['env_s']:.1f} s; "
        + (f"env spend ${costs['usd']:.4f} ({kinds}); " if spend else "")
        + (f"refused stale at batch: {int(waste.get(WASTED, 0))} trajectories, client CPU "
           f"{waste.get(CLIENT_CPU_S, 0.0):.1f} s, env spend ${waste_usd:.4f}; " if waste else "")
        + f"tokens generated {costs['tokens_generated']}, trained {costs['tokens_trained']}; "
        f"per task: {tasks}; "
        + (f"{per:.1f} CPU s per 0.1 of reward gained" if per is not None
           else "no reward gained to price")
        + (f", ${usd_per:.4f} per 0.1" if usd_per is not None else "")
    )
