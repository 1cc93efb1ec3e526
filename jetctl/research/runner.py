"""Run a study: Optuna asks for values, each trial is a `jetctl up`, K at a time, watched.

    run_study(load_study("studies/crash.yaml"), Path("runs/research/crash"), parallel=3)

The loop is one thread: it starts trials while fewer than K run (and the budget allows),
then polls each: new step rows go to the watchdog and, as the metric so far, to Optuna's
pruner (`trial.report(value, step)`); the trial's `jetctl up` exiting 0 completes it with its
metric; exiting otherwise is a crash, resumed with `jetctl up --resume` up to
`watchdog.max_resumes`; a pruned, diverged, collapsed or stalled trial is stopped with
`jetctl down` and told to Optuna as pruned; a trial past `budget.trial_wall_s` is stopped and
completes with the metric it reached.

The study's state is Optuna's sqlite storage (`<study dir>/study.sqlite`); each trial's run
dir, outcome and events are its user attributes. Started again after a crash of its own (or
Ctrl-C), `run_study` adopts the trials the storage still has running: a live `jetctl up` is
watched as it is, a dead one resumed with `--resume`.
"""

from __future__ import annotations

import json
import logging
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from jetctl.research.planner import Planner
from jetctl.research.study import Study
from jetctl.research.trial import TrialRun, metric_value, trial_cost
from jetctl.research.watchdog import StepLog, TrialWatchdog
from jetctl.rundir import RunPaths, peek_run_record

log = logging.getLogger("jetctl.research")

POLL_S = 1.0
INSTALL_HINT = "jetctl research needs optuna: pip install 'jetctl[research]' (or pip install optuna)"


def import_optuna() -> Any:
    try:
        import optuna
    except ImportError as err:
        raise RuntimeError(INSTALL_HINT) from err
    optuna.logging.set_verbosity(optuna.logging.WARNING)
    return optuna


def storage_url(study_dir: Path) -> str:
    return f"sqlite:///{(study_dir / 'study.sqlite').resolve()}"


def open_study(study: Study, study_dir: Path) -> Any:
    """The Optuna study in `<study dir>/study.sqlite`, made on first use, loaded after."""
    optuna = import_optuna()
    spec = study.spec
    sampler: Any
    if spec.search.sampler == "random" or spec.search.sampler == "grid":
        # grid: every combination is enqueued below; Optuna's GridSampler calls study.stop()
        # when its grid is done, which ask-and-tell (a trial per process) cannot take
        sampler = optuna.samplers.RandomSampler(seed=spec.search.seed)
    else:
        sampler = optuna.samplers.TPESampler(seed=spec.search.seed)
    pruner: Any = optuna.pruners.NopPruner()
    if spec.search.pruner == "median":
        pruner = optuna.pruners.MedianPruner(n_startup_trials=2,
                                             n_warmup_steps=spec.search.warmup_steps)
    elif spec.search.pruner == "halving":
        pruner = optuna.pruners.SuccessiveHalvingPruner(min_resource=max(1, spec.search.warmup_steps))
    study_dir.mkdir(parents=True, exist_ok=True)
    ostudy = optuna.create_study(
        storage=storage_url(study_dir), study_name=study.name, load_if_exists=True,
        sampler=sampler, pruner=pruner, direction=spec.metric.direction)
    if not ostudy.trials:
        ostudy.set_user_attr("study_file", str(study.file))
        ostudy.set_user_attr("started_at", time.time())
        if spec.search.include_base:
            ostudy.enqueue_trial(study.base_values(), user_attrs={"base": True})
        if spec.search.sampler == "grid":
            for values in study.grid():
                ostudy.enqueue_trial(values)
    return ostudy


def _suggest(trial: Any, study: Study) -> dict[str, Any]:
    values: dict[str, Any] = {}
    for path, p in study.spec.space.items():
        if p.type == "categorical":
            values[path] = trial.suggest_categorical(path, p.choices)
        elif p.type == "int":
            values[path] = trial.suggest_int(path, int(p.low or 0), int(p.high or 0))
        else:
            values[path] = trial.suggest_float(path, p.low, p.high, log=p.type == "log")
    return values


class StudyRunner:
    def __init__(self, study: Study, study_dir: Path, parallel: int,
                 say: Callable[[str], None] = print) -> None:
        self.study = study
        self.dir = study_dir
        self.parallel = parallel
        self.say = say
        self.optuna = import_optuna()
        self.ostudy = open_study(study, study_dir)
        self.active: dict[int, tuple[Any, TrialRun]] = {}  # number -> (optuna Trial, run)
        self.planner: Planner | None = None
        self._said_spent = False
        if study.spec.planner is not None:
            self.planner = Planner(study.spec.planner, study_dir / "planner.jsonl")

    # -- the loop ---------------------------------------------------------------------------

    def run(self) -> None:
        self._adopt()
        started_at = float(self.ostudy.user_attrs.get("started_at", time.time()))
        try:
            while True:
                wall = self.study.spec.budget.study_wall_s
                open_budget = (wall is None or time.time() - started_at < wall) \
                    and self._study_cost_left()
                while (open_budget and len(self.active) < self.parallel
                       and self._started() < self.study.spec.budget.trials):
                    self._start()
                if not self.active:
                    break
                for number in list(self.active):
                    self._poll(number)
                time.sleep(POLL_S)
        except KeyboardInterrupt:
            self.say("interrupted: stopping the running trials; run the same command to resume")
            for _, run in self.active.values():
                run.stop("interrupted", "the study was interrupted")
            while any(run.exit_code() is None for _, run in self.active.values()):
                time.sleep(POLL_S)
            raise

    def _study_cost_left(self) -> bool:
        """Neither `budget.study_cpu_s` nor `budget.study_usd` is spent (every trial's cost,
        ended ones from their user attributes, running ones as their ledger has it now)."""
        budget = self.study.spec.budget
        if budget.study_cpu_s is None and budget.study_usd is None:
            return True
        cpu = usd = 0.0
        for t in self.ostudy.get_trials(deepcopy=False):
            if t.number in self.active:
                c, u = self._cost(self.active[t.number][1])
            else:
                c, u = t.user_attrs.get("cost", (0.0, 0.0))
            cpu, usd = cpu + c, usd + u
        spent = ((budget.study_cpu_s is not None and cpu >= budget.study_cpu_s)
                 or (budget.study_usd is not None and usd >= budget.study_usd))
        if spent and not self._said_spent:
            self._said_spent = True
            self.say(f"the study's cost budget is spent ({cpu:.0f} CPU s, ${usd:.4f}): "
                     "no new trial starts")
        return not spent

    def _cost(self, run: TrialRun) -> tuple[float, float]:
        return trial_cost(run.run_dir, list(self.study.base.get("models") or {}))

    def _started(self) -> int:
        """Trials started so far (enqueued ones wait in the storage until asked for)."""
        waiting = self.optuna.trial.TrialState.WAITING
        return sum(t.state != waiting for t in self.ostudy.get_trials(deepcopy=False))

    def _new_run(self, number: int, run_dir: Path) -> TrialRun:
        return TrialRun(
            number=number, run_dir=run_dir, recipe=run_dir.with_suffix(".yaml"),
            log=run_dir.with_suffix(".log"),
            steps=StepLog(RunPaths(run_dir).steps_log(self.study.spec.metric.model)),
            watchdog=TrialWatchdog(self.study.spec.watchdog))

    def _start(self) -> None:
        self.plan_next()
        trial = self.optuna_ask()
        values = _suggest(trial, self.study)
        run_dir = (self.dir / "trials" / f"{trial.number:04d}").resolve()
        run = self._new_run(trial.number, run_dir)
        run.recipe.parent.mkdir(parents=True, exist_ok=True)
        run.recipe.write_text(self.study.trial_recipe(values, f"{self.study.name}-{trial.number:04d}"))
        trial.set_user_attr("run_dir", str(run_dir))
        run.launch()
        self.active[trial.number] = (trial, run)
        self.say(f"trial {trial.number} started: {_show(values)} in {run_dir}")

    def optuna_ask(self) -> Any:
        return self.ostudy.ask()

    def plan_next(self) -> bool:
        """Ask the planner (when the study has one, `after_trials` trials have ended and no
        trial waits in the storage) and enqueue its checked proposal; False: the sampler picks."""
        if self.planner is None:
            return False
        state = self.optuna.trial.TrialState
        trials = self.ostudy.get_trials(deepcopy=False)
        if any(t.state == state.WAITING for t in trials):
            return False  # the base recipe's or a planned trial comes first
        ended = [t for t in trials if t.state.is_finished()]
        assert self.study.spec.planner is not None
        if len(ended) < self.study.spec.planner.after_trials:
            return False
        seen = [{"number": t.number, "values": dict(t.params),
                 "outcome": t.user_attrs.get("outcome", t.state.name.lower()),
                 "metric": t.user_attrs.get("metric")} for t in trials
                if t.state != state.WAITING]
        proposal = self.planner.propose(self.study, seen, for_trial=len(trials))
        if proposal is None:
            self.say(f"planner: no usable proposal for trial {len(trials)} "
                     f"(see {self.planner.log_path}); the {self.study.spec.search.sampler} "
                     "sampler picks")
            return False
        self.ostudy.enqueue_trial(proposal.values, user_attrs={"planner": proposal.reasoning})
        self.say(f"planner proposed trial {len(trials)}: {_show(proposal.values)}")
        return True

    def _adopt(self) -> None:
        """Trials a previous `jetctl research` left running: watch or resume them."""
        from jetctl.run.status import controller_alive

        for frozen in self.ostudy.get_trials(deepcopy=False,
                                             states=(self.optuna.trial.TrialState.RUNNING,)):
            trial = self.optuna.trial.Trial(self.ostudy, frozen._trial_id)
            run_dir = Path(frozen.user_attrs.get("run_dir", ""))
            run = self._new_run(frozen.number, run_dir)
            run.events = list(frozen.user_attrs.get("events", []))
            run.resumes = int(frozen.user_attrs.get("resumes", 0))
            run.crashed_on_purpose = bool(frozen.user_attrs.get("crashed_on_purpose", False))
            info = peek_run_record(run_dir)
            if info is not None and info.state == "finished":
                run.events.append("the study restarted; the run had finished")
            elif info is not None and info.controller is not None and controller_alive(info):
                run.adopted_pid = info.controller.pid
                run.events.append("the study restarted; watching the trial's live jetctl up")
            else:
                run.events.append("the study restarted; resumed with jetctl up --resume")
                run.launch(resume=True)
            trial.set_user_attr("events", run.events)
            self.active[frozen.number] = (trial, run)
            self.say(f"trial {frozen.number} adopted from the study's storage ({run.events[-1]})")

    # -- one trial ----------------------------------------------------------------------------

    def _poll(self, number: int) -> None:
        trial, run = self.active[number]
        spec = self.study.spec
        new = run.steps.read_new()
        for row in new:
            verdict = run.watchdog.check_row(row)
            if verdict is not None:
                self._stop(trial, run, verdict.kind, verdict.reason)
        stepped = [r for r in new if r.get("stepped", 1)]
        if stepped and run.stopping is None:
            step = int(stepped[-1]["step"])
            value = metric_value(run.run_dir, spec.metric)
            if value is not None:
                trial.report(value, step)
                if trial.should_prune():
                    self._stop(trial, run, "pruned", f"the {spec.search.pruner} pruner at step "
                               f"{step} ({spec.metric.label} = {value:.3f})")
            chaos = spec.chaos
            if (chaos is not None and chaos.crash_trial == number and not run.crashed_on_purpose
                    and step >= chaos.crash_at_step and run.crash_now()):
                trial.set_user_attr("crashed_on_purpose", True)
                self._event(trial, run, f"step {step}: chaos killed jetctl up (kill -9)")
        if run.stopping is None:
            verdict = run.watchdog.check_stall()
            if verdict is not None:
                self._stop(trial, run, verdict.kind, verdict.reason)
            elif run.elapsed_s > spec.budget.trial_wall_s:
                self._stop(trial, run, "budget", f"trial_wall_s ({spec.budget.trial_wall_s:g}s) "
                           "reached: stopped, scored on what it reached")
            elif new and (spec.budget.trial_cpu_s is not None or spec.budget.trial_usd is not None):
                cpu, usd = self._cost(run)
                trial.set_user_attr("cost", (cpu, usd))
                if spec.budget.trial_cpu_s is not None and cpu > spec.budget.trial_cpu_s:
                    self._stop(trial, run, "budget", f"trial_cpu_s ({spec.budget.trial_cpu_s:g}) "
                               f"reached ({cpu:.0f} CPU s): stopped, scored on what it reached")
                elif spec.budget.trial_usd is not None and usd > spec.budget.trial_usd:
                    self._stop(trial, run, "budget", f"trial_usd ({spec.budget.trial_usd:g}) "
                               f"reached (${usd:.4f}): stopped, scored on what it reached")
        code = run.exit_code()
        if code is None:
            return
        if run.stopping is None and code != 0:
            self._crashed(trial, run, code)
            return
        self._finish(trial, run, run.stopping or ("completed", "the run finished"))

    def _crashed(self, trial: Any, run: TrialRun, code: int) -> None:
        step = int(run.steps.rows[-1]["step"]) if run.steps.rows else 0
        why = f"killed by signal {-code}" if code < 0 else f"exit code {code}"
        if run.proc is None:  # an adopted `up`, not this process's child: no exit code to read
            why = "it exited before the run finished"
        if run.resumes < self.study.spec.watchdog.max_resumes:
            run.resumes += 1
            trial.set_user_attr("resumes", run.resumes)
            self._event(trial, run, f"step {step}: jetctl up crashed ({why}); resumed with "
                        f"jetctl up --resume ({run.resumes} of {self.study.spec.watchdog.max_resumes})")
            run.watchdog.last_progress = time.monotonic()
            run.launch(resume=True)
        else:
            self._event(trial, run, f"step {step}: jetctl up crashed ({why}) with no resume left")
            run.proc = None
            self._stop(trial, run, "failed", f"crashed {run.resumes + 1} times ({why})")

    def _stop(self, trial: Any, run: TrialRun, outcome: str, reason: str) -> None:
        if run.stopping is not None:
            return
        self._event(trial, run, f"stopped: {outcome}: {reason}")
        run.stop(outcome, reason)

    def _event(self, trial: Any, run: TrialRun, text: str) -> None:
        run.events.append(text)
        trial.set_user_attr("events", run.events)
        self.say(f"trial {run.number}: {text}")

    def _finish(self, trial: Any, run: TrialRun, how: tuple[str, str]) -> None:
        outcome, reason = how
        state = self.optuna.trial.TrialState
        value = metric_value(run.run_dir, self.study.spec.metric)
        trial.set_user_attr("cost", self._cost(run))
        trial.set_user_attr("outcome", outcome)
        trial.set_user_attr("reason", reason)
        trial.set_user_attr("steps", int(run.steps.rows[-1]["step"]) if run.steps.rows else 0)
        if value is not None:
            trial.set_user_attr("metric", value)
        if outcome in ("completed", "budget") and value is not None:
            self.ostudy.tell(trial, value)
        elif outcome in ("pruned", "diverged", "collapsed", "stalled"):
            self.ostudy.tell(trial, state=state.PRUNED)
        elif outcome == "interrupted":
            return  # left running in the storage: the next `jetctl research` resumes it
        else:
            self.ostudy.tell(trial, state=state.FAIL)
        del self.active[run.number]
        shown = "no data" if value is None else f"{value:.3f}"
        self.say(f"trial {run.number} {outcome}: {self.study.spec.metric.label} = {shown} ({reason})")


def _show(values: dict[str, Any]) -> str:
    return ", ".join(f"{k}={json.dumps(v)}" for k, v in values.items())


def run_study(study: Study, study_dir: Path, parallel: int,
              say: Callable[[str], None] = print) -> None:
    StudyRunner(study, study_dir, parallel, say).run()
