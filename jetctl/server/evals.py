"""In-run eval: a task's `eval: {every_steps: N}` (jetctl/recipe/schema.py, `EvalConfig`).

After the server checkpoints a step that is a multiple of N, it runs

    jetctl eval RUN_DIR --task T --checkpoint step-S --split test --samples K [--max-rows M] --json

in a process of its own, and hands the figures to the next step row as `eval/<task>/...`
(`pass_at_1`, `pass_at_k`, `mean_reward`, `well_formed`, `tokens_per_answer`, `rows`,
`failed`, `step`, `seconds`): through `Trainer.extra_scalars`, the path that reaches
`steps.jsonl` and `run.trackers`. `jetctl eval` keeps them in RUN_DIR/eval/step-S.<split>.json
(jetctl/run/eval.py), which `jetctl status` shows.

    evals = InRunEval.for_server(run_dir, model, restored_step)   # None: no task asks
    trainer.attach_engine(publish, evals.joined(engine_figures))   # the step row's extras
    evals.start()
    evals.checkpointed(trainer.figures.last_checkpoint_version)   # each tick of the server
    evals.stop()

Why a child process: `jetctl eval` loads its own copy of the model from the checkpoint and
generates with its own batching, so nothing of the server (the engine, the weights lock,
the trainer's version) is shared or paused. It competes for the cores or the GPU: that cost
is what `samples` and `max_rows` bound, and the child's torch gets one CPU thread.

One eval at a time: a thread waits for the newest due step and runs its tasks' evals one
after the other. Checkpoints that come faster than evals finish are skipped (logged): the
thread takes the newest due step, so the figures follow the run instead of falling behind.
A child that fails or runs past `timeout_s` is killed, logged with its last lines of output
and counted in `eval/failures`; training goes on.

Left out: a step whose eval was cut short by the server's stop or restart is not evaluated
again (`jetctl eval RUN_DIR --checkpoint step-S` makes its figures afterwards), and the
figures of an eval that ends after the last optimizer step reach the eval folder but no
step row. The checkpoint an eval reads is pinned while its child runs
(`checkpoint.pinned`): `checkpoint.keep` prunes it only at the first save after the eval
ends, so many fast steps during one eval do not pull it away. Servers without the run dir's
recipe (runtime: external or ray) are refused an `eval:` by validate.
"""

from __future__ import annotations

import json
import logging
import os
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from jetctl.recipe import EvalConfig
from jetctl.server import checkpoint

log = logging.getLogger("jetctl.server.evals")
FIGURES = ("pass_at_1", "pass_at_k", "mean_reward", "well_formed", "tokens_per_answer",
           "rows", "failed", "step")
OUTPUT_TAIL = 5  # lines of a failed child's output in the server log


@dataclass(frozen=True)
class EvalResult:
    task: str
    step: int
    figures: dict[str, float]  # FIGURES and seconds; empty when the eval failed
    error: str  # '' when it succeeded


def eval_argv(run_dir: Path, task: str, step: int, cfg: EvalConfig) -> list[str]:
    """The `jetctl eval` command line of one task's eval at `step`."""
    argv = [sys.executable, "-m", "jetctl.cli.main", "eval", str(run_dir), "--task", task,
            "--checkpoint", f"step-{step}", "--split", cfg.split, "--samples", str(cfg.samples),
            "--json"]
    if cfg.max_rows is not None:
        argv += ["--max-rows", str(cfg.max_rows)]
    return argv


class InRunEval:
    """The evals of one model's tasks, run by its server after each due checkpoint."""

    def __init__(
        self, run_dir: Path, tasks: dict[str, EvalConfig], seen_step: int,
        command: Callable[[Path, str, int, EvalConfig], list[str]] = eval_argv,
    ) -> None:
        self.run_dir = run_dir
        self.tasks = tasks
        self.command = command  # the child's argv (a stand-in in tests/server/test_evals.py)
        self._seen = seen_step  # the last checkpoint looked at (a restart's restored step)
        self._due: int | None = None  # the newest due step not yet taken by the thread
        self._cond = threading.Condition()
        self._stopping = False
        self._child: subprocess.Popen[str] | None = None
        self._scalars: dict[str, float] = {}  # for the next step row
        self._failures = 0
        self._thread: threading.Thread | None = None

    @classmethod
    def for_server(cls, run_dir: Path, model: str, seen_step: int) -> InRunEval | None:
        """The evals of the tasks `model` trains, from the recipe in the run dir's run.json
        (the one `jetctl eval` reads); None when no task asks for one, or the run dir has
        no recipe (a server started without `jetctl up`)."""
        from jetctl.server.trained import TrainedError, open_source

        try:
            recipe = open_source(run_dir).recipe
        except TrainedError as exc:
            log.info("no in-run eval: %s", exc)
            return None
        tasks = {name: t.eval for name, t in recipe.tasks.items()
                 if t.eval is not None and t.model == model}
        return cls(run_dir, tasks, seen_step) if tasks else None

    # --- the server's side ------------------------------------------------------------

    def start(self) -> None:
        self._thread = threading.Thread(target=self._run, name="in-run-eval", daemon=True)
        self._thread.start()

    def checkpointed(self, step: int) -> None:
        """The server's last checkpoint is `step`: due for some task's eval, it is the next
        one evaluated (replacing a due step the thread has not taken yet)."""
        with self._cond:
            if step == self._seen:
                return
            self._seen = step
            if not self.due_tasks(step):
                return
            if self._due is not None:
                log.warning("in-run eval of step %d skipped: step %d is newer and an eval is "
                            "still running", self._due, step)
            self._due = step
            self._cond.notify_all()

    def due_tasks(self, step: int) -> list[str]:
        return [t for t, cfg in self.tasks.items() if step > 0 and step % cfg.every_steps == 0]

    def take_scalars(self) -> dict[str, float]:
        """The figures of the evals finished since the last call (for one step row)."""
        with self._cond:
            out, self._scalars = self._scalars, {}
        return out

    def joined(
        self, other: Callable[[], dict[str, float]] | None
    ) -> Callable[[], dict[str, float]]:
        """`Trainer.extra_scalars` giving `other`'s figures (the engine's) and these."""
        def scalars() -> dict[str, float]:
            return {**(other() if other is not None else {}), **self.take_scalars()}
        return scalars

    def stop(self, timeout_s: float = 10.0) -> None:
        """Kill a running eval (its step is not evaluated) and end the thread."""
        with self._cond:
            self._stopping = True
            child = self._child
            self._cond.notify_all()
        if child is not None and child.poll() is None:
            child.terminate()
        if self._thread is not None:
            self._thread.join(timeout_s)

    # --- the thread ------------------------------------------------------------------

    def _run(self) -> None:
        while True:
            with self._cond:
                self._cond.wait_for(lambda: self._stopping or self._due is not None)
                if self._stopping:
                    return
                step, self._due = self._due, None
            assert step is not None
            for task in self.due_tasks(step):
                result = self.evaluate(task, step)
                with self._cond:
                    if self._stopping:
                        return
                    self._record(result)

    def _record(self, r: EvalResult) -> None:
        if r.error:
            self._failures += 1
            log.warning("in-run eval of %s at step %d failed: %s", r.task, r.step, r.error)
        else:
            log.info("in-run eval of %s at step %d: pass@1 %.3f, mean reward %.3f (%d rows, "
                     "%.0f s)", r.task, r.step, r.figures["pass_at_1"], r.figures["mean_reward"],
                     r.figures["rows"], r.figures["seconds"])
            self._scalars.update({f"eval/{r.task}/{k}": v for k, v in r.figures.items()})
        self._scalars["eval/failures"] = float(self._failures)

    def evaluate(self, task: str, step: int) -> EvalResult:
        """One task's eval at `step` in a child process (blocks until it ends)."""
        cfg = self.tasks[task]
        env = {**os.environ, "OMP_NUM_THREADS": "1"}  # the server keeps its cores
        t0 = time.monotonic()
        with checkpoint.pinned(step):  # not pruned while the child may still load it
            with self._cond:
                if self._stopping:
                    return EvalResult(task, step, {}, "the server is stopping")
                child = self._child = subprocess.Popen(
                    self.command(self.run_dir, task, step, cfg), stdout=subprocess.PIPE,
                    stderr=subprocess.PIPE, text=True, env=env,
                )
            try:
                out, err = child.communicate(timeout=cfg.timeout_s)
            except subprocess.TimeoutExpired:
                child.kill()
                out, err = child.communicate()
                return EvalResult(task, step, {}, f"ran past timeout_s ({cfg.timeout_s:g} s), "
                                  f"killed: {_tail(err)}")
            finally:
                with self._cond:
                    self._child = None
        if child.returncode != 0:
            return EvalResult(task, step, {}, f"exit code {child.returncode}: {_tail(err)}")
        try:
            figures = json.loads(out)[f"step-{step}"][task]
            numbers = {k: float(figures[k]) for k in FIGURES}
        except (ValueError, KeyError, TypeError) as exc:
            return EvalResult(task, step, {}, f"unreadable output ({exc!r}): {_tail(out)}")
        numbers["seconds"] = time.monotonic() - t0
        return EvalResult(task, step, numbers, "")


def _tail(text: str) -> str:
    lines = [line for line in text.strip().splitlines() if line.strip()]
    return " | ".join(lines[-OUTPUT_TAIL:]) or "(no output)"
