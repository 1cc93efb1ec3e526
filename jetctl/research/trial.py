"""One trial: a plain `jetctl up` of the study's modified recipe in its own run directory.

    t = TrialRun(number=0, run_dir=study_dir / "trials" / "0000", recipe=..., log=...)
    t.launch()                 # jetctl up RECIPE --run-dir DIR   (stdout, stderr -> log)
    t.launch(resume=True)      # jetctl up RECIPE --run-dir DIR --resume (after a crash)
    t.stop("pruned", why)      # jetctl down --run-dir DIR: drain, then the process exits
    t.exit_code()              # None while it runs

`metric_value` reads the study's metric from the run dir (the server's store or the step log)
while the trial runs and after it ended.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

from jetctl.controller.plot import read_task_rewards
from jetctl.research.study import Metric
from jetctl.research.watchdog import StepLog, TrialWatchdog
from jetctl.rundir import RunPaths, peek_run_record

DOWN_GRACE_S = 10.0


def jetctl_argv(*args: str) -> list[str]:
    return [sys.executable, "-m", "jetctl.cli.main", *args]


@dataclass
class TrialRun:
    number: int
    run_dir: Path
    recipe: Path
    log: Path
    steps: StepLog
    watchdog: TrialWatchdog
    started: float = field(default_factory=time.monotonic)
    proc: subprocess.Popen[bytes] | None = None
    adopted_pid: int | None = None  # a live `up` left by a study process that died
    down: subprocess.Popen[bytes] | None = None
    stopping: tuple[str, str] | None = None  # (outcome, reason) once `jetctl down` was asked
    resumes: int = 0
    crashed_on_purpose: bool = False
    events: list[str] = field(default_factory=list)

    def launch(self, resume: bool = False) -> None:
        argv = jetctl_argv("up", str(self.recipe), "--run-dir", str(self.run_dir))
        if resume:
            argv.append("--resume")
        self.log.parent.mkdir(parents=True, exist_ok=True)
        with open(self.log, "ab") as out:
            out.write(f"\n$ {' '.join(argv[2:])}\n".encode())
            out.flush()
            # its own session: a kill of the study does not signal it, and `kill -9` of it
            # (chaos) leaves its nodes for `--resume` to adopt, as for any dead controller
            self.proc = subprocess.Popen(argv, stdin=subprocess.DEVNULL, stdout=out,
                                         stderr=subprocess.STDOUT, start_new_session=True,
                                         env={**os.environ, "COLUMNS": "120"})
        self.adopted_pid = None

    def crash_now(self) -> bool:
        """kill -9 the trial's `jetctl up` (chaos): its nodes live on without a controller.
        False when no `up` was running to kill."""
        pid = self.proc.pid if self.proc is not None and self.proc.poll() is None else None
        if pid is None and self.adopted_pid is not None and _pid_alive(self.adopted_pid):
            pid = self.adopted_pid
        if pid is None:
            return False
        os.kill(pid, signal.SIGKILL)
        self.crashed_on_purpose = True
        return True

    def stop(self, outcome: str, reason: str) -> None:
        """Ask the run to drain (`jetctl down`); `exit_code` says when it is over."""
        if self.stopping is not None:
            return
        self.stopping = (outcome, reason)
        with open(self.log, "ab") as out:
            self.down = subprocess.Popen(
                jetctl_argv("down", "--run-dir", str(self.run_dir), "--grace", f"{DOWN_GRACE_S:g}"),
                stdin=subprocess.DEVNULL, stdout=out, stderr=subprocess.STDOUT,
                start_new_session=True)

    def exit_code(self) -> int | None:
        """The `up` process's exit code once it (and any `down` asked of it) is over."""
        if self.down is not None and self.down.poll() is None:
            return None
        if self.proc is not None:
            return self.proc.poll()
        if self.adopted_pid is not None:
            if _pid_alive(self.adopted_pid):
                return None
            info = peek_run_record(self.run_dir)
            return 0 if info is not None and info.state == "finished" else 1
        return 0  # stopped while no process ran (a crash past its resumes, then `down`)

    @property
    def elapsed_s(self) -> float:
        return time.monotonic() - self.started


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def trial_cost(run_dir: Path, models: list[str]) -> tuple[float, float]:
    """(CPU seconds, reported USD) the run's ledger holds so far, over its models: the
    servers' CPU and the client CPU their groups carried (jetctl/costs.py)."""
    from jetctl.costs import read_costs

    cpu = usd = 0.0
    for model in models:
        costs = read_costs(RunPaths(run_dir).steps_log(model))
        if costs is not None:
            cpu += costs.server_cpu_s + costs.client_cpu_s
            usd += costs.usd
    return cpu, usd


def metric_value(run_dir: Path, metric: Metric) -> float | None:
    """The study's metric as the run dir has it now; None before there is any data."""
    if metric.task is not None and metric.eval is not None:
        from jetctl.run.eval import latest_results

        figures = latest_results(run_dir).get(metric.task)
        return None if figures is None else float(figures[metric.eval])
    if metric.task is not None:
        groups = read_task_rewards(run_dir).get((metric.model, metric.task), [])
        window = [g.reward for g in groups[-metric.last_groups:]]
    else:
        log = StepLog(RunPaths(run_dir).steps_log(metric.model))
        rows = [r for r in log.read_new() if r.get("stepped", 1) and r.get(metric.key) is not None]
        window = [float(r[metric.key]) for r in rows[-metric.last_steps:]]
    return sum(window) / len(window) if window else None
