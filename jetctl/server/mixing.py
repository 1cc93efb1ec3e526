"""Mixing ratios: each optimizer step's batch holds its tasks' shares (`train.mix`).

    mix = BatchMix({"web": 0.5, "code": 0.3, "api": 0.2}, groups_per_step=10, wait_s=30.0)
    quotas = mix.quotas()          # {"web": 5, "code": 3, "api": 2}: the next batch's slots
    ...                            # the trainer fills them (jetctl.server.trainer)
    mix.record(taken={"web": 5, "code": 3, "api": 2}, held_up=["api"], backfilled={})
    mix.figures()                  # per task: share of the recent batches, starving or not

A task's quota is its share of `groups_per_step`, rounded by largest remainder; what the
rounding gave or took is carried to the next batch, so over n batches each task's slots are
within one group of `share * groups_per_step * n`. The trainer fills each quota with the
task's informative groups in arrival order. A task that is still short when every other
task's quota is full *holds up* the batch; it is waited for until `wait_s` after the batch
began gathering, then its missing slots are back-filled with other tasks' groups and counted
against it. A task is **starving** when it held up at least three quarters of the last
`WINDOW` batches (the batches waited for its clients) or was back-filled in any of them.

Left out: shares of trajectories or tokens (a share counts groups); groups without signal,
which never take a batch slot whatever their task (dynamic sampling).
"""

from __future__ import annotations

import math
from collections import Counter, deque
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field

WINDOW = 20  # batches the figures cover


@dataclass(frozen=True)
class MixedBatch:
    """What one batch took per task, and who held it up or was back-filled."""

    taken: Mapping[str, int]
    held_up: frozenset[str]
    backfilled: Mapping[str, int]  # task -> its slots other tasks' groups filled


@dataclass
class BatchMix:
    shares: dict[str, float]  # task -> share of each batch (sums to 1)
    groups_per_step: int
    wait_s: float  # how long a batch waits for a short task before back-filling
    _carry: dict[str, float] = field(default_factory=dict)
    recent: deque[MixedBatch] = field(default_factory=lambda: deque(maxlen=WINDOW))
    backfilled_total: Counter[str] = field(default_factory=Counter)

    def quotas(self) -> dict[str, int]:
        """The next batch's slots per task (sum: groups_per_step)."""
        n = self.groups_per_step
        want = {t: s * n + self._carry.get(t, 0.0) for t, s in self.shares.items()}
        quota = {t: max(0, math.floor(w)) for t, w in want.items()}
        left = n - sum(quota.values())
        by_remainder = sorted(want, key=lambda t: (quota[t] - want[t], t))
        for t in by_remainder[: max(0, left)]:
            quota[t] += 1
        for t, w in want.items():
            self._carry[t] = w - quota[t]
        return quota

    def record(
        self, taken: Mapping[str, int], held_up: Iterable[str], backfilled: Mapping[str, int]
    ) -> None:
        self.recent.append(MixedBatch(dict(taken), frozenset(held_up), dict(backfilled)))
        self.backfilled_total.update(backfilled)

    def figures(self) -> dict[str, dict[str, float]]:
        """Per task of the mix: `share` (of the recent batches' groups), `target`, `held_up`
        and `backfilled` (recent batches), `starving` (1.0 or 0.0)."""
        total = sum(sum(b.taken.values()) for b in self.recent)
        out: dict[str, dict[str, float]] = {}
        for task, target in self.shares.items():
            taken = sum(b.taken.get(task, 0) for b in self.recent)
            held = sum(task in b.held_up for b in self.recent)
            filled = sum(b.backfilled.get(task, 0) for b in self.recent)
            starving = bool(self.recent) and (4 * held >= 3 * len(self.recent) or filled > 0)
            out[task] = {
                "share": taken / total if total else 0.0,
                "target": target,
                "held_up": float(held),
                "backfilled": float(filled),
                "starving": float(starving),
            }
        return out
