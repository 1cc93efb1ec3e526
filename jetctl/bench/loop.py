"""`jetctl bench loop RECIPE`: the swarm against a plain synchronous loop, side by side.

    jetctl bench loop recipes/quickstart.yaml --seconds 300 --env-latency 0,2 --seeds 0,1

For each environment latency and seed it runs the recipe's first task (or `--task`) twice,
one after the other on the same machine:

* **swarm**: the real path, `jetctl up` on a recipe cut down to that task and its model
  (`duration_s` = `--seconds`): controller, server, client nodes, rollout processes,
  gRPC, spool, store;
* **loop**: `jetctl.bench.sync_loop`, one process that generates a batch with
  `model.generate`, scores it, takes one step, repeats, with the same model, LoRA, env,
  agent, sampling, groups per step and optimizer.

With a latency, every environment answer sleeps that long (`jetctl.bench.latency`); the loop
runs a batch's environment calls in parallel, so it pays the latency once per turn.

Both are timed from their process start (model loading included) and described by the
same figures, computed the same way from the same kind of records (per group: the time it
was scored and its mean reward; per step: the time): time to the first optimizer step,
seconds per step and trajectories/s after it, time until the mean reward of the last
`WINDOW` groups first reaches each threshold, the final reward, the trainer's busy
fraction, generation batch sizes, staleness and CPU seconds per process role. Every
swarm run's ledger is checked. Ratios are swarm / loop, measured in the same run.
"""

from __future__ import annotations

import json
import os
import sqlite3
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import yaml

WINDOW = 20  # groups in the rolling reward (10 batches of the quickstart's 2 groups)
THRESHOLDS = (0.5, 0.8)
FINAL_GROUPS = 32  # the final reward: mean of the last this many groups
SPREAD_ROWS = ("seconds per step", "reward >= 0.5 at (s)", "reward >= 0.8 at (s)",
               "steps to reward >= 0.8", "groups trained to reward >= 0.8",
               f"reward, last {FINAL_GROUPS} groups")


@dataclass
class RunFigures:
    mode: str  # swarm | loop
    latency_s: float
    seed: int
    wall_s: float
    first_step_s: float | None
    steps: int
    trajectories: int  # scored (trained on or not)
    groups: int
    groups_skipped: int  # all rewards equal: no GRPO signal, no step spent on it
    sec_per_step: float | None
    traj_per_s: float
    reach_s: dict[str, float | None]  # threshold -> seconds (None: never)
    final_reward: float
    first_reward: float
    trainer_busy: float  # share of the time after the first step's end spent training
    gen_batch_mean: float
    staleness_mean: float
    cpu_s: dict[str, float]  # process role -> CPU seconds (user + system)
    algorithm: str = ""  # train.algorithm of both sides
    variant: str = ""  # swarm: its train overrides (--swarm-train), "" the recipe's
    # threshold -> optimizer steps ended by then, and the groups with a signal they trained
    steps_to: dict[str, int | None] = field(default_factory=dict)
    groups_to: dict[str, int | None] = field(default_factory=dict)
    ledger: str = ""  # swarm: "balanced" or the problems
    run_dir: str = ""
    curve: list[tuple[float, float]] = field(default_factory=list)  # (t, rolling reward)
    until: float | None = None  # the run stopped once its rolling reward reached this
    # swarm: its cost ledger per step row (jetctl.costs.Costs.per_step), read after the run
    costs: dict[str, float | None] = field(default_factory=dict)


def figures(
    mode: str, latency_s: float, seed: int, wall_s: float, groups: list[dict[str, Any]],
    step_times: list[float], train: list[tuple[float, float]], gen_batches: list[float],
    staleness: list[float], cpu_s: dict[str, float], skipped: int | None = None,
    step_groups: list[int] | None = None,
) -> RunFigures:
    """The same figures for both modes, from per-group and per-step records (`train`: each
    step's end time and seconds of training; `step_groups`: the groups with a signal each
    step trained, in the order of `step_times`)."""
    groups = sorted(groups, key=lambda g: g["t"])
    order = sorted(range(len(step_times)), key=lambda i: step_times[i])
    trained = [step_groups[i] for i in order] if step_groups is not None else None
    step_times = [step_times[i] for i in order]
    first = step_times[0] if step_times else None
    rewards = [g["reward"] for g in groups]
    curve: list[tuple[float, float]] = []
    reach: dict[str, float | None] = {f"{t:g}": None for t in THRESHOLDS}
    for i in range(WINDOW - 1, len(groups)):
        mean = sum(rewards[i - WINDOW + 1 : i + 1]) / WINDOW
        curve.append((groups[i]["t"], mean))
        for thr in THRESHOLDS:
            if reach[f"{thr:g}"] is None and mean >= thr:
                reach[f"{thr:g}"] = groups[i]["t"]
    after = [g for g in groups if first is not None and g["t"] >= first]
    steps_to: dict[str, int | None] = {}
    groups_to: dict[str, int | None] = {}
    for key, at in reach.items():  # learning per step and per group: what it took to get there
        done = None if at is None else sum(1 for t in step_times if t <= at)
        steps_to[key] = done
        groups_to[key] = None if done is None or trained is None else sum(trained[:done])
    span = wall_s - first if first is not None else 0.0
    sec_per_step = (
        (step_times[-1] - step_times[0]) / (len(step_times) - 1) if len(step_times) > 1 else None
    )
    return RunFigures(
        mode=mode, latency_s=latency_s, seed=seed, wall_s=wall_s, first_step_s=first,
        steps=len(step_times), trajectories=sum(g["n"] for g in groups), groups=len(groups),
        groups_skipped=(
            skipped if skipped is not None else sum(1 for g in groups if not g["informative"])),
        sec_per_step=sec_per_step,
        traj_per_s=sum(g["n"] for g in after) / span if span > 0 else 0.0,
        reach_s=reach, steps_to=steps_to, groups_to=groups_to,
        final_reward=_mean(rewards[-FINAL_GROUPS:]),
        first_reward=_mean(rewards[:FINAL_GROUPS]),
        trainer_busy=_busy(train, first, wall_s),
        gen_batch_mean=_mean(gen_batches),
        staleness_mean=_mean(staleness),
        cpu_s=cpu_s,
        curve=curve,
    )


def _mean(xs: list[float]) -> float:
    return sum(xs) / len(xs) if xs else 0.0


def _busy(train: list[tuple[float, float]], start: float | None, end: float) -> float:
    """The share of [start, end] spent training. Each step trained during the seconds before
    its end time; only the part inside the window counts (the first step trained before
    `start`, its own end: counting it made a loop of a few long steps read over 100%)."""
    if start is None or end <= start:
        return 0.0
    inside = sum(max(0.0, min(t, end) - max(t - s, start)) for t, s in train)
    return inside / (end - start)


# --- the cut-down recipe -------------------------------------------------------------


def task_recipe(
    raw: dict[str, Any], task: str, *, seconds: float, latency_s: float, seed: int, run_dir: Path,
    algorithm: str | None = None, train: dict[str, Any] | None = None,
) -> dict[str, Any]:
    """The recipe with only `task` and its model, run for `seconds`, env slowed by latency,
    trained with `algorithm` (None: the recipe's) and the `train` overrides."""
    t = dict(raw["tasks"][task])
    model = t["model"]
    m = dict(raw["models"][model])
    m["seed"] = seed
    if algorithm is not None:
        m["train"] = {**(m.get("train") or {}), "algorithm": algorithm}
    for key, value in (train or {}).items():  # "lr" -> train.lr; "generation.x" -> as named
        section, _, name = key.rpartition(".")
        block = section or "train"
        m[block] = {**(m.get(block) or {}), name: value}
    t["seed"] = seed
    if latency_s > 0:
        t["env_args"] = {
            "inner": t["env"], "latency_s": latency_s, "inner_args": t.get("env_args") or {},
        }
        t["env"] = "jetctl.bench.latency:make_env"
    run = {k: v for k, v in (raw.get("run") or {}).items() if k not in ("dir", "duration_s")}
    run.update(name=run_dir.name, dir=str(run_dir), duration_s=seconds)
    return {"run": run, "models": {model: m}, "tasks": {task: t}}


# --- swarm -----------------------------------------------------------------------------


class CpuSampler:
    """CPU seconds per process role of a process tree, sampled every `interval_s`.

    Rollout processes are short: they are counted through their forkserver's reaped children
    (`children_user/system`), not one by one. A process keeps the role of the last command
    line read from it: an exiting process (the server, as the run ends) reads an empty one
    while its CPU times still count (it was once filed under "other" then)."""

    def __init__(self, root_pid: int, interval_s: float = 1.0) -> None:
        self.root = root_pid
        self.interval_s = interval_s
        self.last: dict[int, tuple[str, float]] = {}
        self.roles: dict[int, str] = {}
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def start(self) -> None:
        self._thread.start()

    def stop(self) -> dict[str, float]:
        self._stop.set()
        self._thread.join()
        return self.totals()

    def totals(self) -> dict[str, float]:
        """CPU seconds per role, as of the last sample."""
        out: dict[str, float] = {}
        for role, cpu in self.last.values():
            out[role] = out.get(role, 0.0) + cpu
        return out

    def _run(self) -> None:
        import psutil

        while not self._stop.is_set():
            try:
                root = psutil.Process(self.root)
                procs = [root, *root.children(recursive=True)]
            except psutil.NoSuchProcess:
                return
            self.sample(procs)
            self._stop.wait(self.interval_s)

    def sample(self, procs: list[Any]) -> None:
        """Read each process's CPU seconds (`psutil.Process`es, or fakes of their methods)."""
        import psutil

        for p in procs:
            try:
                cmdline = p.cmdline()
                if cmdline:  # empty while the process exits: it keeps its role
                    self.roles[p.pid] = _role(cmdline)
                role = self.roles.get(p.pid)
                if role is None or role == "rollout":
                    continue
                t = p.cpu_times()
                cpu = t.user + t.system
                if role == "rollouts":  # the forkserver and the rollouts it reaped
                    cpu += t.children_user + t.children_system
                self.last[p.pid] = (role, cpu)
            except (psutil.NoSuchProcess, psutil.AccessDenied, psutil.ZombieProcess):
                continue


def _role(cmdline: list[str]) -> str:
    text = " ".join(cmdline)
    if "forkserver" in text:
        return "rollouts"
    if "multiprocessing" in text or "jetctl-rollout" in text:
        return "rollout"
    for arg in cmdline:
        if arg in ("server", "client"):
            return arg
    if " up " in f" {text} ":
        return "controller"
    return "other"


def run_swarm(recipe: dict[str, Any], run_dir: Path, latency_s: float, seed: int,
              until: float | None = None) -> RunFigures:
    """`until`: SIGTERM the run (it drains: the ledger still balances) once the mean reward of
    its last WINDOW accepted groups reaches it."""
    from jetctl.costs import read_costs
    from jetctl.run.ledger import build_ledger

    run_dir.mkdir(parents=True, exist_ok=True)
    path = run_dir.parent / f"{run_dir.name}.yaml"
    path.write_text(yaml.safe_dump(recipe, sort_keys=False))
    model = next(iter(recipe["models"]))
    log = (run_dir.parent / f"{run_dir.name}.up.log").open("w")
    t0_wall = time.time()
    t0 = time.monotonic()
    proc = subprocess.Popen(
        [sys.executable, "-m", "jetctl.cli.main", "up", str(path)],
        stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
        env={**os.environ, "COLUMNS": "120"},
    )
    sampler = CpuSampler(proc.pid)
    sampler.start()
    store = run_dir / f"server-{model}" / "store.sqlite"
    watcher = None
    if until is not None:
        watcher = threading.Thread(target=_stop_when_reached, args=(proc, store, t0_wall, until),
                                   daemon=True, name="bench-until")
        watcher.start()
    _, status, usage = os.wait4(proc.pid, 0)
    proc.returncode = os.waitstatus_to_exitcode(status)  # the watcher sees it: poll() is None no more
    if watcher is not None:
        watcher.join(timeout=5)
    wall = time.monotonic() - t0
    cpu = sampler.stop()
    cpu["all"] = usage.ru_utime + usage.ru_stime
    log.close()
    if proc.returncode != 0:
        raise RuntimeError(f"jetctl up exited {proc.returncode}; see {log.name}")

    steps = [json.loads(line) for line in (run_dir / "metrics" / f"{model}.steps.jsonl")
             .read_text().splitlines() if line.strip()]
    stepped = [s for s in steps if s.get("stepped", 1)]
    groups = _store_groups(store, t0_wall)
    gen = [s["generate/batch_size_mean"] for s in steps if "generate/batch_size_mean" in s]
    fig = figures(
        "swarm", latency_s, seed, wall, groups,
        step_times=[s["time"] - t0_wall for s in stepped],
        train=[(s["time"] - t0_wall, s["timing/train_s"]) for s in steps],
        gen_batches=gen, staleness=[s["staleness/mean"] for s in stepped], cpu_s=cpu,
        skipped=int(sum(s.get("groups/skipped", 0) for s in steps)),
        step_groups=[int(s.get("groups", 0)) for s in stepped],
    )
    ledger = build_ledger(run_dir)
    fig.ledger = "balanced" if ledger.balanced else "NOT BALANCED: " + "; ".join(
        f"{p.kind} {p.trajectory_id}" for p in ledger.problems[:5])
    fig.run_dir = str(run_dir)
    fig.until = until
    ledger_costs = read_costs(run_dir / "metrics" / f"{model}.steps.jsonl")
    fig.costs = ledger_costs.per_step() if ledger_costs is not None else {}
    return fig


def _stop_when_reached(proc: subprocess.Popen[bytes], store: Path, t0_wall: float,
                       until: float, interval_s: float = 2.0) -> None:
    """Poll the store; SIGTERM `proc` once its rolling reward (last WINDOW groups) >= until."""
    import signal

    while proc.returncode is None:
        time.sleep(interval_s)
        if not store.exists():
            continue
        try:
            groups = _store_groups(store, t0_wall)
        except sqlite3.Error:  # the server is creating or migrating it
            continue
        if len(groups) >= WINDOW and sum(g["reward"] for g in groups[-WINDOW:]) / WINDOW >= until:
            if proc.returncode is None:  # os.kill: Popen.poll() here would race the main wait4
                os.kill(proc.pid, signal.SIGTERM)
            return


def _store_groups(path: Path, t0_wall: float) -> list[dict[str, Any]]:
    """Accepted groups (trained or buffered) with their arrival time and mean reward."""
    db = sqlite3.connect(f"file:{path}?mode=ro", uri=True)
    try:
        rows = db.execute(
            "SELECT received_at, reward_sum, n_traj FROM groups "
            "WHERE state IN ('buffered', 'trained') ORDER BY received_at"
        ).fetchall()
    finally:
        db.close()
    return [{"t": at - t0_wall, "reward": total / n, "n": n, "informative": True}
            for at, total, n in rows]


# --- loop ------------------------------------------------------------------------------


def run_loop(recipe: dict[str, Any], out_dir: Path, seconds: float, latency_s: float,
             seed: int, *, dynamic_sampling: bool = False, round_groups: int = 2,
             until: float | None = None) -> RunFigures:
    from jetctl.recipe import Recipe

    rec = Recipe.model_validate(recipe)  # defaults filled in, as the swarm's server sees them
    task_name = next(iter(rec.tasks))
    task = rec.tasks[task_name]
    spec: dict[str, Any] = {
        "model": rec.models[task.models[0]].model_dump(mode="json"),
        "task": task.model_dump(mode="json"),
        "seconds": seconds, "seed": seed, "latency_s": latency_s,
        "dynamic_sampling": dynamic_sampling, "round_groups": round_groups,
        "until": until, "window": WINDOW,
    }
    # the swarm's cut recipe wraps the env for latency; the loop wraps it itself
    if latency_s > 0:
        spec["task"]["env"] = recipe["tasks"][task_name]["env_args"]["inner"]
        spec["task"]["env_args"] = recipe["tasks"][task_name]["env_args"]["inner_args"]
    out_dir.mkdir(parents=True, exist_ok=True)
    spec_path, out_path = out_dir / "loop-spec.json", out_dir / "loop-out.json"
    spec_path.write_text(json.dumps(spec))
    with (out_dir / "loop.log").open("w") as log:
        t0 = time.monotonic()
        proc = subprocess.Popen(
            [sys.executable, "-m", "jetctl.bench.sync_loop", str(spec_path), str(out_path)],
            stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
        )
        _, status, usage = os.wait4(proc.pid, 0)
        wall = time.monotonic() - t0
    if os.waitstatus_to_exitcode(status) != 0:
        raise RuntimeError(f"the loop failed; see {out_dir / 'loop.log'}")
    out = json.loads(out_path.read_text())
    fig = figures(
        "loop", latency_s, seed, wall, out["groups"], out["steps"],
        list(zip(out["steps"], out["train_s"])),
        [float(b) for b in out["gen_batches"]], [0.0] * len(out["steps"]),
        {"loop": usage.ru_utime + usage.ru_stime, "all": usage.ru_utime + usage.ru_stime},
        step_groups=out.get("step_groups"),
    )
    fig.until = until
    return fig


# --- the bench -------------------------------------------------------------------------

def parse_variant(text: str) -> dict[str, Any]:
    """`--swarm-train` text -> the model's overrides: space-separated key=value, each value
    YAML ("tis_cap=2.0 order=newest" -> {"tis_cap": 2.0, "order": "newest"}); a key names a
    field of the model's train block, or `block.field` of another of its blocks
    ("generation.max_batch_size=32")."""
    out: dict[str, Any] = {}
    for part in text.split():
        key, sep, value = part.partition("=")
        if not sep or not key:
            raise ValueError(f"{part!r} is not key=value (e.g. tis_cap=2.0)")
        out[key] = yaml.safe_load(value)
    return out


def check_variant(recipe_path: Path, task: str | None, text: str) -> None:
    """ValueError, with the field and the reason, where `text`'s train overrides do not
    make a valid recipe."""
    import pydantic

    from jetctl.recipe import Recipe

    raw = yaml.safe_load(recipe_path.read_text())
    task = task or next(iter(raw["tasks"]))
    recipe = task_recipe(raw, task, seconds=60, latency_s=0, seed=0,
                         run_dir=Path("check"), train=parse_variant(text))
    try:
        Recipe.model_validate(recipe)
    except pydantic.ValidationError as e:
        first = e.errors()[0]
        where = ".".join(str(x) for x in first["loc"])
        raise ValueError(f"{where}: {first['msg']}") from None


def run(
    recipe_path: Path, *, seconds: float, latencies: list[float], seeds: list[int],
    modes: list[str], task: str | None = None, out_dir: Path | None = None,
    progress: Any = None, loop_dynamic_sampling: bool = False,
    algorithms: list[str] | None = None, loop_groups: int = 2, until: float | None = None,
    variants: list[str] | None = None,
) -> list[RunFigures]:
    """Every (latency, algorithm, seed) run in each mode; `algorithms` None: the recipe's;
    `until`: each run stops once its rolling reward reaches it (else after `seconds`);
    `variants`: more swarm runs per (latency, algorithm, seed), each with those train
    overrides (parse_variant), after the recipe's own; the loop runs once."""
    from jetctl.recipe import Recipe, load_recipe

    load_recipe(recipe_path)  # a broken recipe fails here, with its lines
    raw = yaml.safe_load(recipe_path.read_text())
    task = task or next(iter(raw["tasks"]))
    base = out_dir or Path(tempfile.mkdtemp(prefix="jetctl-bench-loop-"))
    results: list[RunFigures] = []
    choices: list[str | None] = [*algorithms] if algorithms else [None]
    for latency in latencies:
        for algorithm in choices:
            for seed in seeds:
                plan = [(m, "") for m in modes]  # the variants run whatever the modes
                plan += [("swarm", v) for v in variants or []]
                for mode, variant in plan:
                    tag = f"-{algorithm}" if algorithm else ""
                    if variant:
                        tag += "-" + "-".join(variant.split()).replace("=", "")
                    name = f"{mode}{tag}-lat{latency:g}-seed{seed}"
                    if progress:
                        progress(f"{name}: {seconds:g}s")
                    rd = base / name
                    recipe = task_recipe(raw, task, seconds=seconds, latency_s=latency,
                                         seed=seed, run_dir=rd, algorithm=algorithm,
                                         train=parse_variant(variant))
                    if mode == "swarm":
                        fig = run_swarm(recipe, rd, latency, seed, until=until)
                    else:
                        fig = run_loop(recipe, rd, seconds, latency, seed,
                                       dynamic_sampling=loop_dynamic_sampling,
                                       round_groups=loop_groups, until=until)
                    fig.algorithm = Recipe.model_validate(recipe).models[
                        next(iter(recipe["models"]))].train.algorithm
                    fig.variant = variant
                    results.append(fig)
                    # after every run: a bench stopped part way keeps the runs it finished
                    (base / "bench-loop.json").write_text(
                        json.dumps([asdict(r) for r in results], indent=1))
    return results


def median_or_none(xs: list[float | None]) -> float | None:
    vals = [x for x in xs if x is not None]
    if len(vals) < len(xs) / 2 or not vals:
        return None  # most runs never got there
    return statistics.median(vals)


def _seed_ratio(loop_s: list[float | None], swarm_s: list[float | None],
                loop_wall: list[float] | None = None,
                swarm_wall: list[float] | None = None) -> str:
    """One seed's swarm/loop time to a reward: '-' where neither got there; where one side
    did not within its run, a bound from that run's length: '<0.40' (only the swarm got
    there, at 0.40x the loop's whole run) or '>1.50' (only the loop did)."""
    a = loop_s[0] if loop_s else None
    b = swarm_s[0] if swarm_s else None
    if a is None:
        if b is None:
            return "-"
        return f"<{b / loop_wall[0]:.2f}" if loop_wall else "0"
    if b is None:
        return f">{swarm_wall[0] / a:.2f}" if swarm_wall else "inf"
    return f"{b / a:.2f}"


def _reach(threshold: float) -> Any:
    return lambda r: r.reach_s[f"{threshold:g}"]


def _steps_to(threshold: float) -> Any:
    return lambda r: r.steps_to.get(f"{threshold:g}")


def _groups_to(threshold: float) -> Any:
    return lambda r: r.groups_to.get(f"{threshold:g}")


def _cpu(role: str) -> Any:
    return lambda r: r.cpu_s.get(role)


# the swarm's step log (jetctl/costs.py): (label, Costs.per_step key, format)
COST_ROWS = (
    ("server CPU s per step", "server_cpu_s_per_step", "{:.2f}"),
    ("  train CPU s per step", "train_cpu_s_per_step", "{:.2f}"),
    ("  generate CPU s per step", "generate_cpu_s_per_step", "{:.2f}"),
    ("  publish CPU s per step", "publish_cpu_s_per_step", "{:.3f}"),
    ("client CPU s per step", "client_cpu_s_per_step", "{:.2f}"),
    ("tokens generated per step", "tokens_generated_per_step", "{:.0f}"),
    ("env spend $ per step", "usd_per_step", "{:.4f}"),
    ("server CPU s per 0.1 reward", "cpu_s_per_0.1_reward", "{:.1f}"),
    ("refused stale at batch, trajectories per step", "waste_trajectories_per_step", "{:.2f}"),
    ("  their env spend $ per step", "waste_usd_per_step", "{:.4f}"),
    ("train GPU s per step", "train_gpu_s_per_step", "{:.2f}"),  # on a GPU only
    ("generate GPU s per step", "generate_gpu_s_per_step", "{:.2f}"),
    ("publish GPU s per step", "publish_gpu_s_per_step", "{:.3f}"),
)


def _cost(key: str) -> Any:
    return lambda r: r.costs.get(key)


def render(results: list[RunFigures]) -> Any:
    """One table: per latency, loop | swarm | swarm/loop (medians over seeds)."""
    from rich.table import Table

    # a condition: one latency, one algorithm (several: --algorithms) and one swarm variant
    # (--swarm-train; the loop has none and stands beside each)
    conditions = sorted({(r.latency_s, r.algorithm, r.variant) for r in results
                         if r.mode == "swarm" or not any(x.mode == "swarm" for x in results)})
    several = len({r.algorithm for r in results}) > 1
    modes = [m for m in ("loop", "swarm") if any(r.mode == m for r in results)]
    seeds = sorted({r.seed for r in results})
    table = Table(title=f"jetctl bench loop: medians over seeds {seeds}; ratio = swarm / loop")
    table.add_column("figure")
    for lat, alg, variant in conditions:
        name = f"{lat:g}s {alg}" if several else f"{lat:g}s"
        for m in modes:  # the loop runs no variant: its columns repeat beside each
            table.add_column(f"{m} {name}{' ' + variant if variant and m == 'swarm' else ''}",
                             justify="right")
        name += f" {variant}" if variant else ""
        if len(modes) == 2:
            table.add_column(f"ratio {name}", justify="right")

    def pick(condition: tuple[float, str, str], mode: str) -> list[RunFigures]:
        return [r for r in results
                if (r.latency_s, r.algorithm) == condition[:2] and r.mode == mode
                and (mode == "loop" or r.variant == condition[2])]

    rows: list[tuple[str, Any, str]] = [
        ("time to first step (s)", lambda r: r.first_step_s, "{:.1f}"),
        ("optimizer steps", lambda r: r.steps, "{:.0f}"),
        ("seconds per step", lambda r: r.sec_per_step, "{:.2f}"),
        ("trajectories/s", lambda r: r.traj_per_s, "{:.2f}"),
        *[(f"reward >= {t:g} at (s)", _reach(t), "{:.0f}") for t in THRESHOLDS],
        # learning per step and per informative group (the steps and groups trained by then)
        (f"steps to reward >= {THRESHOLDS[-1]:g}", _steps_to(THRESHOLDS[-1]), "{:.0f}"),
        (f"groups trained to reward >= {THRESHOLDS[-1]:g}", _groups_to(THRESHOLDS[-1]),
         "{:.0f}"),
        (f"reward, first {FINAL_GROUPS} groups", lambda r: r.first_reward, "{:.2f}"),
        (f"reward, last {FINAL_GROUPS} groups", lambda r: r.final_reward, "{:.2f}"),
        ("groups skipped (no variance)", lambda r: r.groups_skipped / max(r.groups, 1), "{:.0%}"),
        ("trainer busy", lambda r: r.trainer_busy, "{:.0%}"),
        ("generation batch (mean)", lambda r: r.gen_batch_mean, "{:.1f}"),
        ("staleness (mean lag)", lambda r: r.staleness_mean, "{:.2f}"),
        ("CPU s, all processes", lambda r: r.cpu_s.get("all"), "{:.0f}"),
    ]
    roles = sorted({k for r in results for k in r.cpu_s if k not in ("all", "loop")})
    rows += [(f"  CPU s, {role}", _cpu(role), "{:.0f}") for role in roles]
    if any(r.costs for r in results):  # the swarm's cost ledger (the loop keeps none)
        rows += [(label, _cost(key), fmt) for label, key, fmt in COST_ROWS
                 if any(key in r.costs for r in results)]  # GPU seconds: on a GPU only
    for label, get, fmt in rows:
        cells: list[str] = []
        for cond in conditions:
            meds = {}
            for m in modes:
                runs = pick(cond, m)
                vals = [get(r) for r in runs]
                meds[m] = median_or_none(vals)
                text = "-" if meds[m] is None else fmt.format(meds[m])
                if len(runs) > 1 and label in SPREAD_ROWS:  # the spread: every seed's value
                    text += " (" + ",".join("-" if v is None else fmt.format(v) for v in vals) + ")"
                cells.append(text)
            if len(modes) == 2:
                a, b = meds["loop"], meds["swarm"]
                cells.append(f"{b / a:.2f}x" if a and b is not None and "%" not in fmt else "")
        table.add_row(label, *cells)
    for thr in THRESHOLDS:  # seed by seed: the swarm's time to reward over the loop's
        if len(modes) < 2:
            break
        cells = []
        for cond in conditions:
            ratios = []
            for seed in seeds:
                loops = [r for r in pick(cond, "loop") if r.seed == seed]
                swarms = [r for r in pick(cond, "swarm") if r.seed == seed]
                ratios.append(_seed_ratio([_reach(thr)(r) for r in loops],
                                          [_reach(thr)(r) for r in swarms],
                                          [r.wall_s for r in loops], [r.wall_s for r in swarms]))
            cells += ["", "", ",".join(ratios)]
        table.add_row(f"reward >= {thr:g}, swarm/loop by seed", *cells)
    ledgers = [f"{r.mode} {r.latency_s:g}s{' ' + r.algorithm if several else ''}"
               f"{' ' + r.variant if r.variant else ''} seed {r.seed}: "
               f"{r.ledger}" for r in results if r.ledger]
    from rich.console import Group
    from rich.text import Text

    stops = sorted({r.until for r in results if r.until is not None})
    note = (f"each run stopped once the mean reward of its last {WINDOW} groups reached "
            f"{', '.join(f'{u:g}' for u in stops)} (else at --seconds): rows after that "
            "threshold describe the stop, not a full run" if stops else "")
    return Group(table, Text("ledger: " + "; ".join(ledgers) if ledgers else ""), Text(note))
