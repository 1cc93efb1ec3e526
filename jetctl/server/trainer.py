"""The server's training loop: accepted groups -> staleness gate -> one step -> version += 1.

    refuse buffered groups whose lag > max_staleness (again: the version moved since Submit)
    take buffered groups (train.order: oldest, or newest version first) until
    groups_per_step informative ones are in:
      skip groups whose rewards are all equal (no signal): consumed, counted, no slot
    train_step (jetctl/server/step.py): advantages -> sequences -> packing -> per
      micro-batch forward, loss, backward -> clipping
    under the weights lock: optimizer step, version += 1  (generation sees whole versions)
    mark the groups trained at that version; publish; log the step (and send it to
      run.trackers, jetctl/trackers.py); checkpoint every K steps

Gathering (`step_once` down to `_close`) is what this file owns; the gradients of a step are
step.py's, the loss the algorithm's (`train.algorithm`, jetctl/server/algorithms/), and the
running figures and their verdicts figures.py's.

Dynamic sampling (DAPO, Yu et al. 2025): a group whose G rewards are all equal has every
advantage 0 and moves nothing, so it never takes a batch slot; every optimizer step trains
on exactly `groups_per_step` informative groups, and every step row reports the share of
groups skipped. A task most of whose recent groups carry no signal (`Status.signal_by_task`:
`solved` when most of those scored its best reward seen, else `collapsed`) is shown as such.

Runs in its own thread beside the inference engine, on the same model object: forward and
backward only read the weights, so generation continues during them; only the optimizer
step excludes generation. Version = optimizer steps completed.

The model stays in eval mode (the engine shares it). With LoRA, the trainer's forward sees
`lora.dropout` and the KL penalty's reference (the base model: the adapter switched off)
through per-thread switches (`jetctl/server/adapter.py`), so generation never sees either.
"""

from __future__ import annotations

import json
import os
import threading
import time
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from jetctl import tracing
from jetctl.costs import add_waste, gpu_split, step_client_costs
from jetctl.faults import Faults
from jetctl.proto.convert import weight_frames
from jetctl.recipe import ModelConfig
from jetctl.server import algorithms, memory
from jetctl.server import checkpoint as ckpt
from jetctl.server import weights as W
from jetctl.server.figures import TrainerFigures
from jetctl.server.locks import WeightsLock
from jetctl.server.mixing import BatchMix
from jetctl.server.step import train_step
from jetctl.server.store import StoredGroup, TrajectoryStore
from jetctl.trackers import Trackers


class Trainer:
    def __init__(
        self,
        model: Any,
        cfg: ModelConfig,
        store: TrajectoryStore,
        *,
        weights_lock: threading.Lock | WeightsLock,
        checkpoint_dir: str | os.PathLike[str],  # a folder or an fsspec URL
        steps_log: Path,
        on_step: Callable[[dict[str, float]], None] | None = None,
        faults: Faults | None = None,
        publish: Callable[[int], float] | None = None,
        threads: int | None = None,
        extra_scalars: Callable[[], dict[str, float]] | None = None,
        trackers: Trackers | None = None,
    ) -> None:
        self.model = model
        self.cfg = cfg
        self.store = store
        self.lock = weights_lock
        self.checkpoint_dir = checkpoint_dir
        self.steps_log = steps_log
        self.on_step = on_step
        self.faults = faults or Faults()
        # torch CPU threads of the training thread (None: train.threads, else as set)
        self.threads = threads or cfg.train.threads
        self.extra_scalars = extra_scalars  # more figures for each step row (the engine's)
        self.trackers = trackers  # run.trackers: each step row goes there too (jetctl.trackers)
        if cfg.train.kl_coef > 0 and not W.is_lora(model):
            raise ValueError(
                "train.kl_coef > 0 needs finetune: lora (the reference is the base model with "
                "the adapter off); full fine-tuning keeps no reference copy"
            )
        # an engine with its own copy of the weights: called after each optimizer step
        # (engines/replica.py: bounded by its deadline; raises when it stays unreachable)
        self.publish = publish
        self.device = next(model.parameters()).device
        params = [p for p in model.parameters() if p.requires_grad]
        self.optimizer = make_optimizer(params, cfg)
        self.params = params
        self.algorithm = algorithms.make(cfg.train)
        self.version = 0
        self.figures = TrainerFigures()
        self._frames: tuple[int, int, list[bytes]] | None = None  # (version, chunk, frames)
        self._frames_lock = threading.Lock()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self.error: BaseException | None = None
        self.busy_since: float | None = None  # monotonic start of the step under way (watchdog)
        # True while a step's forward/backward and optimizer step run (train.lend_threads:
        # the engine borrows this thread's CPU threads while it is False)
        self.computing = False
        self._ready: list[StoredGroup] = []  # informative groups gathered for the next step
        self._skipped: list[Skipped] = []  # consumed without signal since the last step
        self._gather_since: float | None = None
        mix = cfg.train.mix
        self.mix = (
            BatchMix(dict(mix), cfg.train.groups_per_step, cfg.train.mix_wait_s) if mix else None
        )
        self._quota: dict[str, int] | None = None  # the batch being gathered's slots per task
        self._cpu_mark = time.process_time()  # the server's CPU seconds at the last step row
        self._wall_mark = time.monotonic()  # ... and the wall clock (GPU seconds, on CUDA)
        self._stale_waste: dict[str, dict[str, float]] = {}  # task -> refused at batch time
        self._held_up: set[str] = set()  # tasks this batch waited for, the others full

    # --- lifecycle -------------------------------------------------------------------

    def resume(self) -> int:
        """Load the last complete checkpoint (if any); returns the version it restores."""
        restored = ckpt.restore(self.checkpoint_dir, self.model, self.optimizer)
        if restored is not None:
            self.version = restored.version
            self.figures.last_checkpoint_version = restored.version
        return self.version

    def attach_engine(
        self,
        publish: Callable[[int], float] | None,
        extra_scalars: Callable[[], dict[str, float]] | None,
    ) -> None:
        """The serving engine's hooks, as `__init__` takes them, for a trainer built before
        its engine: the server (jetctl/server/app.py) builds the engine after `resume`, since
        the engine starts at the restored version and a replica copies the restored weights."""
        if self._thread is not None:
            raise RuntimeError("attach the engine before the trainer starts")
        self.publish = publish
        self.extra_scalars = extra_scalars

    def start(self) -> None:
        self._thread = threading.Thread(target=self._run, name="trainer", daemon=True)
        self._thread.start()

    def stop(self, timeout_s: float = 120.0) -> None:
        """Finish the current step, then checkpoint if anything is new since the last one."""
        self._stop.set()
        if self._thread:
            self._thread.join(timeout_s)
        self.give_back_ready()
        if self.version != self.figures.last_checkpoint_version:
            self.checkpoint()

    @property
    def done(self) -> bool:
        limit = self.cfg.train.max_steps
        return limit is not None and self.version >= limit

    def _run(self) -> None:
        if self.threads:
            torch.set_num_threads(self.threads)  # this thread's pool only
        try:
            while not self._stop.is_set() and not self.done:
                self.busy_since = time.monotonic()
                self.step_once(wait_s=0.5)
                self.busy_since = None
        except BaseException as exc:  # surfaced through Status and the server log
            self.error = exc
            raise

    # --- one step --------------------------------------------------------------------

    def step_once(self, wait_s: float) -> dict[str, float] | None:
        """Train on groups_per_step informative groups once they are in; returns the step
        scalars (None while still gathering). Groups without signal are consumed on the way.
        With `train.mix`, each task fills its share of the batch (`_step_mixed`)."""
        tc = self.cfg.train
        if self._gather_since is None:
            self._gather_since = time.monotonic()
        self._consume(self.store.take_older_than(self.version - tc.max_staleness))
        if self.mix is not None:
            return self._step_mixed(self.mix, wait_s)
        self._consume(self._take(tc.groups_per_step - len(self._ready), wait_s))
        if len(self._ready) < tc.groups_per_step:
            return None
        batch, self._ready = self._ready[: tc.groups_per_step], self._ready[tc.groups_per_step :]
        return self._close(batch)

    def _take(self, n: int, wait_s: float, tasks: set[str] | None = None) -> list[StoredGroup]:
        """Up to n buffered groups in `train.order` (of `tasks` only, when given)."""
        return self.store.take(n, wait_s, tasks=tasks,
                               newest_first=self.cfg.train.order == "newest")

    def _consume(self, taken: list[StoredGroup]) -> None:
        """Taken groups: too stale ones rejected, ones without signal consumed at this
        version, informative ones gathered for a step (`_ready`)."""
        tc = self.cfg.train
        stale: list[StoredGroup] = []
        flat: list[StoredGroup] = []
        for s in taken:
            if s.facts.lag(self.version) > tc.max_staleness:  # a stale group is not decoded
                stale.append(s)
            elif _no_signal(s):
                flat.append(s)
            else:
                self._ready.append(s)
            if s not in stale:
                self._note_consumed(s)
        if stale:
            self.store.mark_rejected(
                [s.id for s in stale],
                f"stale: lag > max_staleness {tc.max_staleness} at batch time",
            )
            self.figures.stale_at_batch += sum(s.facts.n_trajectories for s in stale)
            for s in stale:  # their costs bought nothing: the next row's waste (jetctl/costs.py)
                tally = self._stale_waste.setdefault(s.group.task, {})
                for t in s.group.trajectories:
                    add_waste(tally, t.costs)
        if flat:  # consumed at this version without a step (the ledger's `trained`)
            self.store.mark_trained([s.id for s in flat], self.version)
            # what the next step's row needs of them, not the groups (a run whose groups all
            # lack signal takes no step: holding the groups grew the server ~18 KB a group)
            self._skipped += [Skipped.of(s) for s in flat]
            self.figures.skipped_groups += len(flat)
            self.figures.trained_groups += len(flat)
            self.figures.trained_trajectories += sum(s.facts.n_trajectories for s in flat)

    def _close(self, batch: list[StoredGroup]) -> dict[str, float]:
        skipped, self._skipped = self._skipped, []
        wait_s_spent = time.monotonic() - (self._gather_since or time.monotonic())
        self._gather_since = None
        return self._train(batch, wait_s_spent, skipped)

    def _step_mixed(self, mix: BatchMix, wait_s: float) -> dict[str, float] | None:
        """One step's batch by `train.mix` (jetctl.server.mixing): each task's informative
        groups fill its quota; a task still short when the others are full holds the batch
        up until `mix_wait_s` after gathering began, then other tasks' groups back-fill its
        slots (counted against it)."""
        if self._quota is None:
            self._quota, self._held_up = mix.quotas(), set()
        short = self._short()
        if short:
            taken = [s for t, n in short.items() for s in self._take(n, 0.0, tasks={t})]
            if not taken:  # wait for a short task's next group, not past the back-fill time
                left = mix.wait_s - (time.monotonic() - (self._gather_since or 0.0))
                taken = self._take(1, max(0.0, min(wait_s, left)), tasks=set(short))
            self._consume(taken)
            short = self._short()
        if not short:
            return self._close_mixed(mix)
        if len(short) < sum(1 for q in self._quota.values() if q > 0):
            self._held_up |= set(short)  # every other task's quota is full
        if time.monotonic() - (self._gather_since or 0.0) < mix.wait_s:
            return None
        need = self.cfg.train.groups_per_step - len(self._ready)
        if need > 0:  # back-fill from whatever task has groups
            self._consume(self._take(need, min(wait_s, 0.5)))
        if len(self._ready) < self.cfg.train.groups_per_step:
            return None
        return self._close_mixed(mix)

    def _short(self) -> dict[str, int]:
        """Tasks whose quota the gathered groups do not fill yet -> groups missing."""
        assert self._quota is not None
        have = Counter(s.facts.task for s in self._ready)
        return {t: q - have[t] for t, q in self._quota.items() if have[t] < q}

    def _close_mixed(self, mix: BatchMix) -> dict[str, float]:
        """Each task's quota from the gathered groups in arrival order, then back-fill."""
        assert self._quota is not None
        batch: list[StoredGroup] = []
        rest: list[StoredGroup] = []
        used: Counter[str] = Counter()
        for s in self._ready:
            if used[s.facts.task] < self._quota.get(s.facts.task, 0):
                batch.append(s)
                used[s.facts.task] += 1
            else:
                rest.append(s)
        backfilled = {t: q - used[t] for t, q in self._quota.items() if used[t] < q}
        fill = self.cfg.train.groups_per_step - len(batch)
        batch, self._ready = batch + rest[:fill], rest[fill:]
        mix.record(Counter(s.facts.task for s in batch), self._held_up, backfilled)
        self._quota = None
        return self._close(batch)

    def _note_consumed(self, s: StoredGroup) -> None:
        rewards = [t.reward for t in s.group.trajectories]
        self.figures.note_consumed(s.group.task, not _no_signal(s), sum(rewards) / len(rewards))

    @property
    def groups_waiting(self) -> int:
        """Accepted groups not yet trained: in the store's buffer or gathered for a step."""
        return self.store.buffer_depth + len(self._ready)

    def give_back_ready(self) -> None:
        """Return the informative groups gathered for the next step to the store's buffer."""
        ready, self._ready = self._ready, []
        self._quota = None
        if ready:
            self.store.give_back(ready)

    def _train(
        self, batch: list[StoredGroup], wait_s: float, skipped: list[Skipped] | None = None,
    ) -> dict[str, float]:
        t0 = time.monotonic()
        cpu0 = time.thread_time()  # the trainer thread's CPU: the step's train seconds
        version_before = self.version
        memory.reset_peak(self.device)
        skipped = skipped or []
        lags = [s.facts.lag(self.version) for s in batch]
        for s, lag in zip(batch, lags):
            self.figures.note_lag(s.facts.task, lag)
        self.computing = True
        try:
            result = train_step(
                self.model, [s.group.trajectories for s in batch], self.cfg.train,
                self.algorithm, max_grad_norm=self.cfg.optimizer.max_grad_norm,
            )
            scalars = dict(result.scalars)
            with self.lock:
                if result.trained:
                    self.optimizer.step()
                    self.version += 1
                self.optimizer.zero_grad(set_to_none=True)
        finally:
            self.computing = False
        _synchronize(self.device)  # on CUDA, the step's kernels are done: its GPU seconds
        t_train = time.monotonic() - t0
        train_cpu_s = time.thread_time() - cpu0
        ids = [s.id for s in batch]
        self.store.mark_trained(ids, self.version)
        tracing.optimizer_step(self.version, [s.group for s in batch], t_train)
        publish_s = 0.0
        cpu1 = time.thread_time()
        if self.publish is not None and self.version != version_before:
            publish_s = self.publish(self.version)
            _synchronize(self.device)
        publish_cpu_s = time.thread_time() - cpu1

        n_traj = sum(len(s.group.trajectories) for s in batch)
        f = self.figures
        f.trained_groups += len(batch)
        f.trained_trajectories += n_traj
        f.tokens_trained += int(scalars.get("num_tokens", 0))
        rewards = [t.reward for s in batch for t in s.group.trajectories]  # trained on
        # the rollouts' reward: every group consumed for this step, skipped ones included
        consumed = rewards + [r for s in skipped for r in s.rewards]
        f.recent_rewards = (f.recent_rewards + consumed)[-256:]
        mean = sum(consumed) / len(consumed)
        std = (sum((r - mean) ** 2 for r in consumed) / len(consumed)) ** 0.5
        no_signal, signal = f.signal()
        zero_std = result.groups_without_signal
        scalars.update(
            {
                "step": float(self.version),
                "stepped": float(self.version != version_before),
                "time": time.time(),
                "reward/mean": mean,
                "reward/std": std,
                "reward/trained_mean": sum(rewards) / len(rewards),
                "frac_reward_zero_std": (zero_std + len(skipped)) / (len(batch) + len(skipped)),
                "groups/skipped": float(len(skipped)),
                "trajectories/skipped": float(sum(len(s.rewards) for s in skipped)),
                "signal/no_signal_recent": no_signal,
                "signal/collapsed": float(signal == "collapsed"),
                "groups": float(len(batch)),
                "trajectories": float(n_traj),
                "response_length/mean": result.response_tokens / max(n_traj, 1),
                "learning_rate": self.optimizer.param_groups[0]["lr"],
                "staleness/mean": sum(lags) / len(lags),
                "staleness/max": float(max(lags)),
                "timing/wait_s": wait_s,
                "timing/train_s": t_train,
                "timing/publish_s": publish_s,
                "buffer/depth": float(self.groups_waiting),
            }
        )
        scalars.update(memory.memory_figures(self.device))
        by_task = _tokens_by_task(batch, skipped)
        server_cpu_s, self._cpu_mark = time.process_time() - self._cpu_mark, time.process_time()
        scalars.update({  # the cost ledger's figures (jetctl/costs.py sums them)
            "cost/server_cpu_s": server_cpu_s,  # the whole process since the last step row
            "cost/train_cpu_s": train_cpu_s,
            "cost/publish_cpu_s": publish_cpu_s,
            # the rest: generation above all, with admission, gRPC and gathering
            "cost/generate_cpu_s": max(0.0, server_cpu_s - train_cpu_s - publish_cpu_s),
            "tokens/generated": float(sum(g for g, _ in by_task.values())),
            "tokens/trained": float(sum(t for _, t in by_task.values())),
        })
        interval_s, self._wall_mark = time.monotonic() - self._wall_mark, time.monotonic()
        if self.device.type == "cuda":  # absent on a CPU, not 0: there is no GPU to price
            scalars.update(gpu_split(interval_s, t_train, publish_s))
        client_scalars, client_by_task = step_client_costs(  # usd, client CPU, env wall
            [(s.group.task, t.costs) for s in batch for t in s.group.trajectories]
            + [(k.task, c) for k in skipped for c in k.costs])
        scalars.update(client_scalars)
        if "num_tokens" in scalars and t_train > 0:
            scalars["tokens_per_second"] = scalars["num_tokens"] / t_train
        f.last_step = scalars
        if self.extra_scalars is not None:
            scalars.update(self.extra_scalars())
        if self.trackers is not None:
            scalars["trackers/failures"] = float(self.trackers.failures)
        waste, self._stale_waste = self._stale_waste, {}
        self._log(scalars, ids, by_task, client_by_task, waste)
        if self.trackers is not None:
            self.trackers.log(scalars, [s.group for s in batch], self.algorithm.advantages)
        if self.on_step:
            self.on_step(scalars)
        if self.version != version_before and self.version % self.cfg.checkpoint.every_steps == 0:
            self.checkpoint()
        return scalars

    # --- publishing and checkpoints -----------------------------------------------------

    def weight_frames(self, chunk_bytes: int, lock_timeout_s: float = 120.0) -> list[bytes]:
        """The current version's trainable weights as PullWeights messages, made once per
        version (every later pull of it streams the same bytes): hashed in place and cut
        into frames straight from the live tensors under the weights lock, one copy.

        Raises TimeoutError when the weights lock stays held longer than `lock_timeout_s`
        (a hung step or generation): PullWeights fails loudly instead of stalling.
        """
        with self._frames_lock:
            if self._frames is None or self._frames[:2] != (self.version, chunk_bytes):
                if not self.lock.acquire(timeout=lock_timeout_s):
                    raise TimeoutError(
                        f"the weights lock was held for more than {lock_timeout_s:g}s "
                        "(a training step or generation batch hangs)"
                    )
                try:
                    version = self.version
                    frames = weight_frames(W.view(self.model, version), chunk_bytes)
                finally:
                    self.lock.release()
                self._frames = (version, chunk_bytes, frames)
            return self._frames[2]

    def checkpoint(self) -> str:
        with self.lock:
            path = ckpt.save(
                self.checkpoint_dir, self.model, self.optimizer, self.version,
                {"version": self.version, "time": time.time()}, keep=self.cfg.checkpoint.keep,
                before_manifest=lambda: self.faults.pause("stall_checkpoint"),
            )
        self.figures.last_checkpoint_version = self.version
        self.figures.last_checkpoint_time = time.time()
        self._forget_trained_groups()
        return path

    def _forget_trained_groups(self) -> None:
        """Drop the tokens of groups trained at or before the checkpoint that
        `checkpoint.keep_trained_groups` counts back to (all: none dropped). The groups after
        it replay from it (jetctl/run/replay.py); a restart needs those after the newest."""
        n = self.cfg.checkpoint.trained_groups_checkpoints
        if n is None:
            return
        # a newer checkpoint than this version is one a refused restore passed over
        done = [v for v in ckpt.versions(self.checkpoint_dir) if v <= self.version]
        if len(done) >= n:
            self.store.forget_payloads(through_step=done[-n])

    def _log(self, scalars: dict[str, float], group_ids: list[str],
             by_task: dict[str, tuple[int, int]],
             client_by_task: dict[str, dict[str, float]],
             waste_by_task: dict[str, dict[str, float]]) -> None:
        # what `jetctl replay` needs (jetctl/run/replay.py): the batch's groups in training order,
        # the torch threads (CPU sums depend on them) and, with LoRA, a digest of the adapter
        # after the step (a few MB at most; full fine-tuning's weights are too big to hash
        # every step). In the log only: the trackers and on_step get the scalars.
        row: dict[str, object] = {**scalars, "replay/group_ids": group_ids,
                                  "replay/threads": torch.get_num_threads()}
        # per task: [generated, trained] completion tokens (jetctl/costs.py)
        row["cost/tokens_by_task"] = {t: list(v) for t, v in sorted(by_task.items())}
        row["cost/client_by_task"] = client_by_task  # task -> summed Trajectory.costs
        if waste_by_task:  # task -> costs of the groups refused stale since the last row
            row["cost/waste_by_task"] = {t: dict(sorted(c.items()))
                                         for t, c in sorted(waste_by_task.items())}
        if W.is_lora(self.model):
            row["replay/weights_sha256"] = W.digest(self.model)
        self.steps_log.parent.mkdir(parents=True, exist_ok=True)
        with self.steps_log.open("a") as f:
            f.write(json.dumps(row) + "\n")


def make_optimizer(params: list[torch.nn.Parameter], cfg: ModelConfig) -> torch.optim.Optimizer:
    """The trainer's optimizer over `params` (also what `jetctl replay` rebuilds)."""
    opt = cfg.optimizer
    return torch.optim.AdamW(params, lr=opt.lr, betas=opt.betas, weight_decay=opt.weight_decay)


@dataclass(frozen=True)
class Skipped:
    """What a step's row needs of a group consumed without signal since the last step."""

    task: str
    rewards: tuple[float, ...]
    completion_tokens: int
    costs: tuple[dict[str, float], ...] = ()  # each trajectory's (jetctl/costs.py)

    @classmethod
    def of(cls, s: StoredGroup) -> Skipped:
        return cls(
            s.group.task, tuple(t.reward for t in s.group.trajectories),
            sum(len(c.completion_ids) for t in s.group.trajectories for c in t.calls),
            tuple(t.costs for t in s.group.trajectories),
        )


def _tokens_by_task(
    batch: list[StoredGroup], skipped: list[Skipped],
) -> dict[str, tuple[int, int]]:
    """task -> (completion tokens generated, of them trained) over the groups this step
    consumed: every one was generated, the batch's were trained on (skipped ones carry no
    signal). One pass over each group's calls (already decoded for the step)."""
    out: dict[str, tuple[int, int]] = {}
    for s in batch:
        n = sum(len(c.completion_ids) for t in s.group.trajectories for c in t.calls)
        g, t = out.get(s.group.task, (0, 0))
        out[s.group.task] = (g + n, t + n)
    for k in skipped:
        g, t = out.get(k.task, (0, 0))
        out[k.task] = (g + k.completion_tokens, t)
    return out


def _synchronize(device: torch.device) -> None:
    """Wait for the device's queued kernels (CUDA); a CPU runs them as they are called."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _no_signal(s: StoredGroup) -> bool:
    """All G rewards equal: every advantage is 0 (each algorithm's), the group moves nothing."""
    rewards = [t.reward for t in s.group.trajectories]
    return max(rewards) - min(rewards) < 1e-9
