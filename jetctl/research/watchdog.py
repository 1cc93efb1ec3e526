"""A trial's watchdog: reads its step log as it grows and says when the trial is hopeless.

    log = StepLog(RunPaths(run_dir).steps_log("policy"))
    dog = TrialWatchdog(study.spec.watchdog)
    for row in log.read_new():
        verdict = dog.check_row(row)          # None, or why the trial must stop
    verdict = dog.check_stall(now)            # no step for watchdog.stall_s

Verdicts: `diverged` (loss or grad norm NaN, infinite, or past its limit), `collapsed` (the
trainer's `signal/collapsed` for `collapsed_steps` steps in a row: most groups score the same
below the best reward, so GRPO has no signal), `stalled` (no step row for `stall_s`, counted
from the trial's start or its last step). A crash (the `jetctl up` process exiting non-zero) is
the runner's to see: it owns the process.
"""

from __future__ import annotations

import json
import math
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from jetctl.research.study import Watchdog


class StepLog:
    """The complete JSON lines of a step log, read incrementally (a half-written line waits)."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self._offset = 0
        self.rows: list[dict[str, Any]] = []

    def read_new(self) -> list[dict[str, Any]]:
        try:
            with open(self.path, "rb") as f:
                f.seek(self._offset)
                data = f.read()
        except FileNotFoundError:
            return []
        end = data.rfind(b"\n") + 1  # only whole lines
        self._offset += end
        new: list[dict[str, Any]] = []
        for line in data[:end].splitlines():
            try:
                row = json.loads(line)
            except ValueError:
                continue
            if isinstance(row, dict) and "step" in row:
                new.append(row)
        self.rows += new
        return new


@dataclass(frozen=True)
class Verdict:
    kind: str  # diverged | collapsed | stalled
    reason: str


class TrialWatchdog:
    def __init__(self, cfg: Watchdog, start: float | None = None) -> None:
        self.cfg = cfg
        self.last_progress = time.monotonic() if start is None else start
        self._collapsed_run = 0

    def check_row(self, row: dict[str, Any], now: float | None = None) -> Verdict | None:
        self.last_progress = time.monotonic() if now is None else now
        step = int(row.get("step", 0))
        for key, limit in (("loss", self.cfg.loss_limit), ("grad_norm", self.cfg.grad_norm_limit)):
            value = row.get(key)
            if value is None:
                continue
            value = float(value)
            if not math.isfinite(value) or abs(value) > limit:
                return Verdict("diverged", f"{key} = {value:g} at step {step} (limit {limit:g})")
        if row.get("stepped", 1) and float(row.get("signal/collapsed", 0.0)) >= 1.0:
            self._collapsed_run += 1
        elif row.get("stepped", 1):
            self._collapsed_run = 0
        if self._collapsed_run >= self.cfg.collapsed_steps:
            return Verdict("collapsed", f"signal/collapsed for {self._collapsed_run} steps in a "
                           f"row up to step {step}: groups score alike, no signal to learn from")
        return None

    def check_stall(self, now: float | None = None) -> Verdict | None:
        now = time.monotonic() if now is None else now
        quiet = now - self.last_progress
        if quiet > self.cfg.stall_s:
            return Verdict("stalled", f"no step for {quiet:.0f}s (watchdog.stall_s "
                           f"{self.cfg.stall_s:g})")
        return None
