"""The server's training loop: accepted groups -> staleness gate -> merge/pack -> GRPO -> step.

    refuse buffered groups whose lag > max_staleness (again: the version moved since Submit)
    take buffered groups (train.order: oldest, or newest version first) until
    groups_per_step informative ones are in:
      skip groups whose rewards are all equal (no GRPO signal): consumed, counted, no slot
    advantages per group -> training sequences (timeline merge) -> micro-batches (packing)
    forward/backward per micro-batch (gradient accumulation, token-mean loss)
    under the weights lock: optimizer step, version += 1  (generation sees whole versions)
    mark the groups trained at that version; checkpoint every K steps

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
`accumulate_gradients` is the forward/backward of one step; `jetctl bench merge` calls it.

Left out: a KL reference for full fine-tuning (it would be a second copy of the model;
`train.kl_coef > 0` with `finetune: full` is refused by the recipe).
"""

from __future__ import annotations

import json
import os
import threading
import time
from collections import Counter, deque
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from jetctl.faults import Faults
from jetctl.models import AttnImplementation, Progress
from jetctl.proto.convert import weight_frames
from jetctl.recipe import ModelConfig, TrainConfig
from jetctl.server import checkpoint as ckpt
from jetctl.server import memory, merge
from jetctl.server import weights as W
from jetctl.server.adapter import adapter_mode
from jetctl.server.algorithms.grpo import LossStats, group_advantages, grpo_loss
from jetctl.server.locks import WeightsLock
from jetctl.server.mixing import BatchMix
from jetctl.server.store import StoredGroup, TrajectoryStore


def load_trainable(
    cfg: ModelConfig,
    attn_implementation: AttnImplementation = "jetctl_tree",
    progress: bool | Progress = False,
) -> tuple[Any, Any]:
    """The model the server trains (LoRA-wrapped when finetune is lora) and its tokenizer.

    `jetctl_tree`: sdpa for generation and padded micro-batches, and only the visible scores
    of tree-packed ones (merge: tree); the same values as eager up to fp32 rounding order.
    """
    from jetctl.models import load_model
    from jetctl.server import adapter

    torch.manual_seed(cfg.seed)
    base, tokenizer = load_model(
        cfg.model, dtype=cfg.dtype, device=cfg.device, attn_implementation=attn_implementation,
        progress=progress,
    )
    model: Any = base
    if cfg.finetune == "lora":
        from peft import LoraConfig, get_peft_model

        lc = cfg.lora
        model = get_peft_model(
            model,
            LoraConfig(
                r=lc.r, lora_alpha=lc.alpha, lora_dropout=lc.dropout,
                target_modules=list(lc.target_modules), task_type="CAUSAL_LM",
            ),
        )
        adapter.install(model, lc.dropout)  # dropout in the trainer's thread only
    else:
        for p in model.parameters():
            p.requires_grad_(True)
    model.eval()  # shared with the engine; training-only behaviour is per thread (adapter.py)
    return model, tokenizer


@dataclass
class Accumulated:
    """What one step's forward/backward over its micro-batches left besides the gradients."""

    loss: float
    stats: list[tuple[int, LossStats]]  # (scored tokens, stats) per micro-batch
    normalizer: int  # scored tokens of the step
    forward_s: float  # reference forwards included
    backward_s: float


def accumulate_gradients(
    model: Any, microbatches: list[merge.MicroBatch], tc: TrainConfig
) -> Accumulated:
    """Forward (+ reference forward when kl_coef > 0), GRPO loss and backward per micro-batch,
    summing gradients into `.grad`; the loss is a token mean over the whole step."""
    normalizer = sum(mb.num_targets for mb in microbatches)
    use_reference = tc.kl_coef > 0
    loss_total = forward_s = backward_s = 0.0
    stats: list[tuple[int, LossStats]] = []
    for mb in microbatches:
        t0 = time.perf_counter()
        ref_lp = None
        if use_reference:
            with torch.no_grad(), adapter_mode("reference"):
                ref_lp = merge.token_logprobs(model, mb)
        with adapter_mode("train"):
            new_lp = merge.token_logprobs(model, mb)
        loss, st = grpo_loss(
            new_lp, mb.old_logprobs.to(new_lp.device), mb.advantages.to(new_lp.device),
            clip_eps=tc.clip_eps, normalizer=normalizer, ref_logprobs=ref_lp,
            kl_coef=tc.kl_coef,
        )
        t1 = time.perf_counter()
        loss.backward()
        backward_s += time.perf_counter() - t1
        forward_s += t1 - t0
        loss_total += float(loss.detach())
        stats.append((mb.num_targets, st))
        del new_lp, ref_lp, loss
    return Accumulated(loss_total, stats, normalizer, forward_s, backward_s)


SIGNAL_WINDOW = 64  # consumed groups (per task) behind Status.signal_by_task
LAG_WINDOW = 32  # trained groups per task behind Status.staleness_by_task
NO_SIGNAL_SHARE = 0.8  # above this share of equal-reward groups, the run has no signal


@dataclass
class TrainerFigures:
    """Running totals read by Status and /metrics."""

    trained_groups: int = 0
    trained_trajectories: int = 0
    tokens_trained: int = 0
    stale_at_batch: int = 0
    recent_rewards: list[float] = field(default_factory=list)
    last_step: dict[str, float] = field(default_factory=dict)
    last_checkpoint_version: int = -1
    last_checkpoint_time: float = 0.0
    skipped_groups: int = 0  # all rewards equal: consumed without a batch slot
    # the last SIGNAL_WINDOW consumed groups, whatever their task: informative or not
    recent_informative: deque[bool] = field(default_factory=lambda: deque(maxlen=SIGNAL_WINDOW))
    # task -> its last SIGNAL_WINDOW consumed groups: (informative, mean reward)
    recent_signal: dict[str, deque[tuple[bool, float]]] = field(default_factory=dict)
    best_reward: dict[str, float] = field(default_factory=dict)  # task -> best group mean seen
    # task -> the lags (versions behind at the step) of its last LAG_WINDOW trained groups
    recent_lags: dict[str, deque[int]] = field(default_factory=dict)

    def note_lag(self, task: str, lag: int) -> None:
        """A group of `task` went into a step `lag` versions behind the trainer."""
        self.recent_lags.setdefault(task, deque(maxlen=LAG_WINDOW)).append(lag)

    def staleness_by_task(self) -> dict[str, float]:
        """Per task: the mean lag of its last LAG_WINDOW groups trained in a step."""
        # copies: Status reads while the trainer's thread appends
        windows = {task: list(lags) for task, lags in list(self.recent_lags.items())}
        return {task: sum(lags) / len(lags) for task, lags in windows.items() if lags}

    def note_consumed(self, task: str, informative: bool, mean: float) -> None:
        """A group of `task` was consumed (trained, or skipped without signal)."""
        self.best_reward[task] = max(self.best_reward.get(task, float("-inf")), mean)
        self.recent_signal.setdefault(task, deque(maxlen=SIGNAL_WINDOW)).append(
            (informative, mean))
        self.recent_informative.append(informative)

    def signal_by_task(self) -> dict[str, tuple[float, str]]:
        """task -> (share of its last SIGNAL_WINDOW groups without signal, verdict).

        `ok` while fewer than half a window is in or under NO_SIGNAL_SHARE of it is flat;
        else `solved` when most of its flat groups scored the best group mean the task has
        seen (every rollout right), `collapsed` when most scored the same below it (one
        answer for every sample, not the best: nothing left to learn from, and no way up).
        Judged per task: tasks have different best rewards, and one task solved beside
        another still learning is neither.
        """
        out: dict[str, tuple[float, str]] = {}
        for task, window in list(self.recent_signal.items()):  # the trainer thread appends
            recent = list(window)
            flat = [mean for informative, mean in recent if not informative]
            share = len(flat) / len(recent) if recent else 0.0
            if len(recent) < SIGNAL_WINDOW // 2 or share < NO_SIGNAL_SHARE:
                out[task] = (share, "ok")
                continue
            best = self.best_reward.get(task, float("-inf"))
            at_best = sum(1 for mean in flat if mean >= best - 1e-9)
            out[task] = (share, "solved" if 2 * at_best >= len(flat) else "collapsed")
        return out

    def signal(self) -> tuple[float, str]:
        """(share of the last SIGNAL_WINDOW groups without signal, over all tasks; the run's
        verdict): `collapsed` when a task collapsed, `solved` when every task is solved, else
        `ok` (`signal_by_task` says which task)."""
        recent = list(self.recent_informative)
        share = (len(recent) - sum(recent)) / len(recent) if recent else 0.0
        verdicts = {verdict for _, verdict in self.signal_by_task().values()}
        if "collapsed" in verdicts:
            return share, "collapsed"
        return share, "solved" if verdicts == {"solved"} else "ok"


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
        opt = cfg.optimizer
        self.optimizer = torch.optim.AdamW(
            params, lr=opt.lr, betas=opt.betas, weight_decay=opt.weight_decay
        )
        self.params = params
        self.version = 0
        self.figures = TrainerFigures()
        self._frames: tuple[int, int, list[bytes]] | None = None  # (version, chunk, frames)
        self._frames_lock = threading.Lock()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self.error: BaseException | None = None
        self.busy_since: float | None = None  # monotonic start of the step under way (watchdog)
        self._ready: list[StoredGroup] = []  # informative groups gathered for the next step
        self._skipped: list[StoredGroup] = []  # consumed without signal since the last step
        self._gather_since: float | None = None
        mix = cfg.train.mix
        self.mix = (
            BatchMix(dict(mix), cfg.train.groups_per_step, cfg.train.mix_wait_s) if mix else None
        )
        self._quota: dict[str, int] | None = None  # the batch being gathered's slots per task
        self._held_up: set[str] = set()  # tasks this batch waited for, the others full

    # --- lifecycle -------------------------------------------------------------------

    def resume(self) -> int:
        """Load the last complete checkpoint (if any); returns the version it restores."""
        restored = ckpt.restore(self.checkpoint_dir, self.model, self.optimizer)
        if restored is not None:
            self.version = restored.version
            self.figures.last_checkpoint_version = restored.version
        return self.version

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
            if s.group.lag(self.version) > tc.max_staleness:
                stale.append(s)
            elif _no_signal(s):
                flat.append(s)
            else:
                self._ready.append(s)
            if s not in stale:
                self._note_consumed(s)
        if stale:
            self.store.mark_rejected(
                [s.group.id for s in stale],
                f"stale: lag > max_staleness {tc.max_staleness} at batch time",
            )
            self.figures.stale_at_batch += sum(len(s.group.trajectories) for s in stale)
        if flat:  # consumed at this version without a step (the ledger's `trained`)
            self.store.mark_trained([s.group.id for s in flat], self.version)
            self._skipped += flat
            self.figures.skipped_groups += len(flat)
            self.figures.trained_groups += len(flat)
            self.figures.trained_trajectories += sum(len(s.group.trajectories) for s in flat)

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
        self, batch: list[StoredGroup], wait_s: float, skipped: list[StoredGroup] | None = None,
    ) -> dict[str, float]:
        tc = self.cfg.train
        t0 = time.monotonic()
        version_before = self.version
        memory.reset_peak(self.device)
        skipped = skipped or []
        sequences: list[merge.TrainSequence] = []
        tokens_naive = 0  # what training call by call would feed (the merge statistic)
        rewards: list[float] = []  # of the groups trained on
        lags: list[int] = []
        zero_std = 0
        response_tokens = 0
        for s in batch:
            g = s.group
            group_rewards = [t.reward for t in g.trajectories]
            rewards += group_rewards
            lags.append(g.lag(self.version))
            self.figures.note_lag(g.task, lags[-1])
            advantages = group_advantages(group_rewards)
            if all(a == 0.0 for a in advantages):
                zero_std += 1
                continue
            for t, a in zip(g.trajectories, advantages):
                response_tokens += sum(len(c.completion_ids) for c in t.calls)
                sequences += merge.timeline_sequences(t, a, tc.merge)
                tokens_naive += sum(
                    len(c.prompt_ids) + len(c.completion_ids) for c in t.calls if c.completion_ids)

        scalars: dict[str, float] = {}
        if sequences:
            scalars = self._optimize(sequences, tokens_naive)
        with self.lock:
            if sequences:
                self.optimizer.step()
                self.version += 1
            self.optimizer.zero_grad(set_to_none=True)
        t_train = time.monotonic() - t0
        ids = [s.group.id for s in batch]
        self.store.mark_trained(ids, self.version)
        publish_s = 0.0
        if self.publish is not None and self.version != version_before:
            publish_s = self.publish(self.version)

        n_traj = sum(len(s.group.trajectories) for s in batch)
        f = self.figures
        f.trained_groups += len(batch)
        f.trained_trajectories += n_traj
        f.tokens_trained += int(scalars.get("num_tokens", 0))
        # the rollouts' reward: every group consumed for this step, skipped ones included
        consumed = rewards + [t.reward for s in skipped for t in s.group.trajectories]
        f.recent_rewards = (f.recent_rewards + consumed)[-256:]
        mean = sum(consumed) / len(consumed)
        std = (sum((r - mean) ** 2 for r in consumed) / len(consumed)) ** 0.5
        no_signal, signal = f.signal()
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
                "trajectories/skipped": float(sum(len(s.group.trajectories) for s in skipped)),
                "signal/no_signal_recent": no_signal,
                "signal/collapsed": float(signal == "collapsed"),
                "groups": float(len(batch)),
                "trajectories": float(n_traj),
                "response_length/mean": response_tokens / max(n_traj, 1),
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
        if "num_tokens" in scalars and t_train > 0:
            scalars["tokens_per_second"] = scalars["num_tokens"] / t_train
        f.last_step = scalars
        if self.extra_scalars is not None:
            scalars.update(self.extra_scalars())
        self._log(scalars)
        if self.on_step:
            self.on_step(scalars)
        if self.version != version_before and self.version % self.cfg.checkpoint.every_steps == 0:
            self.checkpoint()
        return scalars

    def _optimize(
        self, sequences: list[merge.TrainSequence], tokens_naive: int
    ) -> dict[str, float]:
        tc = self.cfg.train
        microbatches = merge.pack(sequences, tc.merge, tc.max_tokens_per_microbatch)
        acc = accumulate_gradients(self.model, microbatches, tc)
        grad_norm = torch.nn.utils.clip_grad_norm_(
            self.params, self.cfg.optimizer.max_grad_norm
        )
        w = [n / max(acc.normalizer, 1) for n, _ in acc.stats]
        stats = [st for _, st in acc.stats]
        tokens_packed = sum(mb.num_tokens for mb in microbatches)
        return {
            "loss": acc.loss,
            "grad_norm": float(grad_norm),
            "kl": sum(wi * st.approx_kl for wi, st in zip(w, stats)),
            "kl_ref": sum(wi * st.ref_kl for wi, st in zip(w, stats)),
            "clip_fraction": sum(wi * st.clip_fraction for wi, st in zip(w, stats)),
            "importance_ratio/mean": sum(wi * st.ratio_mean for wi, st in zip(w, stats)),
            "importance_ratio/min": min(st.ratio_min for st in stats),
            "importance_ratio/max": max(st.ratio_max for st in stats),
            "num_tokens": float(tokens_packed),
            "merge/tokens_naive": float(tokens_naive),
            "merge/tokens_packed": float(tokens_packed),
            "merge/ratio": tokens_naive / max(tokens_packed, 1),
            "microbatches": float(len(microbatches)),
            "scored_tokens": float(acc.normalizer),
        }

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
        self.store.forget_payloads(through_step=self.version)
        return path

    def _log(self, scalars: dict[str, float]) -> None:
        self.steps_log.parent.mkdir(parents=True, exist_ok=True)
        with self.steps_log.open("a") as f:
            f.write(json.dumps(scalars) + "\n")


def _no_signal(s: StoredGroup) -> bool:
    """All G rewards equal: every GRPO advantage is 0, the group moves nothing."""
    rewards = [t.reward for t in s.group.trajectories]
    return max(rewards) - min(rewards) < 1e-9
