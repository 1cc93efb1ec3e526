"""The trainer's running figures and its verdicts on them, read by Status and /metrics.

`TrainerFigures` counts what the trainer consumed (trained, skipped without signal, refused
as stale) and keeps short windows per task, from which it judges each task's learning
signal (`signal_by_task`: ok, solved or collapsed) and staleness (`staleness_by_task`).
The trainer's thread writes; Status reads from gRPC threads, so readers copy the windows.
"""

from __future__ import annotations

import time
from collections import deque
from dataclasses import dataclass, field

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


class RecentRate:
    """A count over the last `window_s` seconds, kept in one-second buckets: its memory is
    bounded (window_s + 1 buckets) whether or not anyone reads it, and `add` is O(1) (the
    Submit path calls it once per accepted group)."""

    def __init__(self, window_s: int = 60) -> None:
        self.window_s = window_s
        self._buckets: deque[list[int]] = deque(maxlen=window_s + 1)  # [second, count]

    def add(self, n: int, now: float | None = None) -> None:
        second = int(time.monotonic() if now is None else now)
        if self._buckets and self._buckets[-1][0] == second:
            self._buckets[-1][1] += n
        else:
            self._buckets.append([second, n])

    def total(self, now: float | None = None) -> int:
        """What was added in the last `window_s` seconds (to the second)."""
        second = int(time.monotonic() if now is None else now)
        return sum(n for s, n in list(self._buckets) if second - s < self.window_s)
