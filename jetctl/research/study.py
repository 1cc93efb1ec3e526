"""A study file: the base recipe, the hypothesis, the metric, the budget, the search space.

    study = load_study("studies/crash.yaml")     # StudyError with every problem, by line
    recipe_text = study.trial_recipe({"models.policy.optimizer.lr": 3e-3}, "crash-0001")

Every value the search space can take is checked against the base recipe at load time (its
bounds, each choice, each grid value): a value the recipe would refuse is reported at the
study's line for that field, with the recipe's own message and fix, so a study never starts
a trial `jetctl up` refuses. Problems are rendered like `jetctl validate`'s:
`FILE:LINE: key.path = value: constraint and fix`.
"""

from __future__ import annotations

import copy
import difflib
import itertools
from pathlib import Path
from typing import Any, Literal

import yaml
from pydantic import BaseModel, ConfigDict, Field, ValidationError, model_validator

from jetctl.recipe import RecipeError, RecipeIssue, parse_recipe


class StudyError(RecipeError):
    """Every problem found in one study file (rendered like a recipe's)."""


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid")


class StudyInfo(_Strict):
    name: str = Field(pattern=r"^[A-Za-z0-9][A-Za-z0-9_.-]*$", description="names the study dir")
    recipe: str = Field(description="the base recipe, relative to the study file")
    dir: str | None = Field(default=None, description="default: runs/research/<name>")


class Hypothesis(_Strict):
    statement: str
    # held when the best trial's metric reaches this value ...
    metric_at_least: float | None = None
    # ... and/or when the best trial beats the base recipe's own trial by this margin
    beats_base_by: float | None = Field(default=None, ge=0)


class Metric(_Strict):
    """`task` and `eval` set: that figure of the task's newest eval (its in-run eval,
    `tasks.<task>.eval`, or any `jetctl eval` of the trial's run dir). `task` alone: the mean
    reward of that task's last `last_groups` accepted groups (the server's store, as `jetctl
    status` shows it). Else: the mean of `key` over the last `last_steps` rows of the step
    log."""

    model: str = "policy"
    task: str | None = None
    last_groups: int = Field(default=32, ge=1)
    key: str = "reward/mean"
    last_steps: int = Field(default=10, ge=1)
    direction: Literal["maximize", "minimize"] = "maximize"
    eval: Literal["pass_at_1", "pass_at_k", "mean_reward", "well_formed"] | None = None

    @property
    def label(self) -> str:
        if self.task is not None and self.eval is not None:
            return f"{self.eval} of the newest eval of {self.task}"
        if self.task is not None:
            return f"mean reward of the last {self.last_groups} groups of {self.task}"
        return f"mean {self.key} of the last {self.last_steps} steps"


class Budget(_Strict):
    trials: int = Field(ge=1, description="trials in the study")
    max_steps: int | None = Field(default=None, ge=1, description="train.max_steps of each trial")
    trial_wall_s: float = Field(default=1800.0, gt=0, description="a trial is stopped after this")
    study_wall_s: float | None = Field(default=None, gt=0, description="no trial starts after this")
    # cost from the run's ledger (jetctl/costs.py: the step log's server CPU seconds, the
    # client CPU seconds its groups carried, and what envs reported spending)
    trial_cpu_s: float | None = Field(
        default=None, gt=0, description="a trial is stopped (scored on what it reached) past this "
        "many server + client CPU seconds")
    trial_usd: float | None = Field(
        default=None, gt=0, description="a trial is stopped past this much reported env spend")
    study_cpu_s: float | None = Field(
        default=None, gt=0, description="no trial starts once the trials' CPU seconds reach this")
    study_usd: float | None = Field(
        default=None, gt=0, description="no trial starts once the trials' reported spend reaches this")


class Search(_Strict):
    sampler: Literal["tpe", "random", "grid"] = "tpe"
    pruner: Literal["median", "halving", "none"] = "median"
    warmup_steps: int = Field(default=5, ge=0, description="steps before a trial may be pruned")
    seed: int = 0
    parallel: int = Field(default=1, ge=1, description="trials at once (--parallel overrides)")
    include_base: bool = Field(default=False, description="trial 0 runs the base recipe's values")


class Param(_Strict):
    type: Literal["float", "log", "int", "categorical"]
    low: float | None = None
    high: float | None = None
    choices: list[Any] | None = None
    grid: list[Any] | None = Field(default=None, description="the values a grid search tries")

    @model_validator(mode="after")
    def _shape(self) -> Param:
        if self.type == "categorical":
            if not self.choices:
                raise ValueError("a categorical parameter needs choices: [a, b, ...]")
        elif self.low is None or self.high is None or self.low >= self.high:
            raise ValueError(f"a {self.type} parameter needs low < high (low: ..., high: ...)")
        elif self.type == "log" and self.low <= 0:
            raise ValueError("a log parameter needs low > 0 (it is sampled on a log scale)")
        return self

    def values_to_check(self) -> list[Any]:
        if self.type == "categorical":
            return list(self.choices or [])
        bounds: list[Any] = [self.low, self.high]
        if self.type == "int":
            bounds = [int(b) for b in bounds if b is not None]
        return bounds + list(self.grid or [])


class Watchdog(_Strict):
    stall_s: float = Field(default=600.0, gt=0, description="no new step for this long: stalled")
    max_resumes: int = Field(default=2, ge=0, description="`up --resume` after crashes, at most")
    loss_limit: float = Field(default=1.0e4, gt=0, description="|loss| above this: diverged")
    grad_norm_limit: float = Field(default=1.0e4, gt=0, description="grad norm above: diverged")
    collapsed_steps: int = Field(default=20, ge=1, description="steps in a row collapsed: pruned")


class Chaos(_Strict):
    """Make a trial crash on purpose (the watchdog's test): kill -9 its `jetctl up` once."""

    crash_trial: int = Field(ge=0, description="the trial number to crash")
    crash_at_step: int = Field(default=2, ge=1, description="once its step log reaches this step")


class PlannerConfig(_Strict):
    """A model proposing trials (jetctl/research/planner.py); the study runs without it."""

    base_url: str = Field(pattern=r"^https?://", description="an OpenAI-compatible endpoint")
    model: str = Field(min_length=1)
    api_key_env: str | None = Field(
        default=None, pattern=r"^[A-Za-z_][A-Za-z0-9_]*$",
        description="the environment variable holding the key (the key never goes in the file)")
    after_trials: int = Field(default=1, ge=0, description="trials ended before it proposes")
    timeout_s: float = Field(default=120.0, gt=0)
    max_tokens: int = Field(default=512, ge=16)
    temperature: float = Field(default=0.2, ge=0, le=2)


class StudyFile(_Strict):
    study: StudyInfo
    hypothesis: Hypothesis
    metric: Metric = Metric()
    budget: Budget
    search: Search = Search()
    space: dict[str, Param] = Field(min_length=1)
    watchdog: Watchdog = Watchdog()
    chaos: Chaos | None = None
    planner: PlannerConfig | None = None


class Study:
    """A loaded, validated study: its file's fields and the base recipe's YAML."""

    def __init__(self, spec: StudyFile, file: Path, base: dict[str, Any]) -> None:
        self.spec = spec
        self.file = file
        self.base = base

    @property
    def name(self) -> str:
        return self.spec.study.name

    @property
    def recipe_path(self) -> Path:
        return (self.file.parent / self.spec.study.recipe).resolve()

    def default_dir(self) -> Path:
        return Path(self.spec.study.dir or f"runs/research/{self.name}")

    def base_values(self) -> dict[str, Any]:
        """The base recipe's value at each dotted path of the space (missing: skipped)."""
        out: dict[str, Any] = {}
        for path in self.spec.space:
            node: Any = self.base
            for part in path.split("."):
                node = node.get(part) if isinstance(node, dict) else None
            if node is not None:
                out[path] = node
        return out

    def grid(self) -> list[dict[str, Any]]:
        """Every combination of the space's grid values (or choices), in the order written."""
        axes = [[(path, v) for v in (p.choices if p.type == "categorical" else p.grid) or []]
                for path, p in self.spec.space.items()]
        return [dict(combo) for combo in itertools.product(*axes)]

    def trial_recipe(self, values: dict[str, Any], run_name: str) -> str:
        """The base recipe with `values` set, run.name set and train.max_steps from the budget."""
        doc = copy.deepcopy(self.base)
        for path, value in values.items():
            set_dotted(doc, path, value)
        set_dotted(doc, "run.name", run_name)
        if self.spec.budget.max_steps is not None:
            for model in doc.get("models") or {}:
                set_dotted(doc, f"models.{model}.train.max_steps", self.spec.budget.max_steps)
        header = f"# written by `jetctl research {self.file}`: {values}\n"
        return header + yaml.safe_dump(doc, sort_keys=False)


def set_dotted(doc: dict[str, Any], path: str, value: Any) -> None:
    parts = path.split(".")
    node = doc
    for part in parts[:-1]:
        child = node.get(part)
        if not isinstance(child, dict):
            child = node[part] = {}
        node = child
    node[parts[-1]] = value


# --------------------------------------------------------------------------- loading


def load_study(path: str | Path) -> Study:
    """Read and validate a study file and its space against the base recipe; `StudyError`."""
    file = Path(path)
    try:
        text = file.read_text(encoding="utf-8")
    except OSError as err:
        raise StudyError([RecipeIssue(str(file), None, "", err.strerror or str(err))]) from None
    try:
        root = yaml.compose(text)
        data = yaml.safe_load(text)
    except yaml.MarkedYAMLError as err:
        line = err.problem_mark.line + 1 if err.problem_mark else None
        raise StudyError([RecipeIssue(str(file), line, "", f"YAML syntax error: {err.problem}")]) from None
    lines: dict[tuple[str, ...], int] = {}
    if root is not None:
        _line_map(root, (), lines)
    if not isinstance(data, dict):
        raise StudyError([RecipeIssue(str(file), 1, "", "a study is a mapping: study:, hypothesis:, "
                                      "metric:, budget:, space: (see studies/crash.yaml)")])
    try:
        spec = StudyFile.model_validate(data)
    except ValidationError as err:
        raise StudyError([_issue(str(file), e, lines) for e in err.errors()]) from None
    study = Study(spec, file, _read_base(spec, file, lines))
    issues = _check_space(study, lines) + _check_cross(study, lines)
    if issues:
        raise StudyError(issues)
    return study


def _read_base(spec: StudyFile, file: Path, lines: dict[tuple[str, ...], int]) -> dict[str, Any]:
    recipe = (file.parent / spec.study.recipe).resolve()
    where = lines.get(("study", "recipe"))
    try:
        base = yaml.safe_load(recipe.read_text(encoding="utf-8"))
    except (OSError, yaml.YAMLError) as err:
        raise StudyError([RecipeIssue(
            str(file), where, "study.recipe", f"cannot read the recipe ({err}); the path is "
            "relative to the study file", spec.study.recipe, True)]) from None
    if not isinstance(base, dict):
        raise StudyError([RecipeIssue(str(file), where, "study.recipe", "not a recipe mapping",
                                      spec.study.recipe, True)])
    return base


def _check_space(study: Study, lines: dict[tuple[str, ...], int]) -> list[RecipeIssue]:
    """Every value the space can take, set into the base recipe, must validate."""
    issues: list[RecipeIssue] = []
    file = str(study.file)
    for path, param in study.spec.space.items():
        for value in param.values_to_check():
            doc = copy.deepcopy(study.base)
            set_dotted(doc, path, value)
            try:
                parse_recipe(yaml.safe_dump(doc), file=str(study.recipe_path))
            except RecipeError as err:
                found = [i for i in err.issues if i.path == path or path.startswith(i.path + ".")
                         or i.path.startswith(path)]
                for issue in found or err.issues[:1]:
                    issues.append(RecipeIssue(
                        file, lines.get(("space", path)), f"space.{path}",
                        f"the recipe refuses {issue.path} = {value!r}: {issue.message}",
                        value, True))
                break
    return issues


def _check_cross(study: Study, lines: dict[tuple[str, ...], int]) -> list[RecipeIssue]:
    spec, file, issues = study.spec, str(study.file), []
    if spec.search.sampler == "grid":
        for path, param in spec.space.items():
            if param.type != "categorical" and not param.grid:
                issues.append(RecipeIssue(
                    file, lines.get(("space", path)), f"space.{path}",
                    f"sampler grid needs the values to try: add grid: [...] within "
                    f"[{param.low}, {param.high}], or make it categorical"))
    if spec.search.sampler == "grid" and not issues and len(study.grid()) < spec.budget.trials:
        issues.append(RecipeIssue(
            file, lines.get(("budget", "trials")), "budget.trials",
            f"the grid has {len(study.grid())} combinations: set budget.trials to at most that",
            spec.budget.trials, True))
    if spec.chaos is not None and spec.chaos.crash_trial >= spec.budget.trials:
        issues.append(RecipeIssue(
            file, lines.get(("chaos", "crash_trial")), "chaos.crash_trial",
            f"there are {spec.budget.trials} trials (0 to {spec.budget.trials - 1})",
            spec.chaos.crash_trial, True))
    if spec.planner is not None and spec.search.sampler == "grid":
        issues.append(RecipeIssue(
            file, lines.get(("planner",)), "planner",
            "a grid study tries every combination in order, so there is nothing to plan: "
            "remove planner: or set search.sampler: tpe (or random)"))
    if spec.hypothesis.beats_base_by is not None and not spec.search.include_base:
        issues.append(RecipeIssue(
            file, lines.get(("hypothesis", "beats_base_by")), "hypothesis.beats_base_by",
            "comparing with the base recipe needs its trial: set search.include_base: true",
            spec.hypothesis.beats_base_by, True))
    models = study.base.get("models") or {}
    if spec.metric.model not in models:
        close = difflib.get_close_matches(spec.metric.model, list(models), n=1)
        hint = f"; did you mean {close[0]!r}?" if close else ""
        issues.append(RecipeIssue(file, lines.get(("metric", "model")), "metric.model",
                                  f"not a model of the recipe ({', '.join(models)}){hint}",
                                  spec.metric.model, True))
    tasks = study.base.get("tasks") or {}
    if spec.metric.eval is not None and spec.metric.task is None:
        issues.append(RecipeIssue(file, lines.get(("metric", "eval")), "metric.eval",
                                  "an eval figure is a task's: set metric.task too",
                                  spec.metric.eval, True))
    elif (spec.metric.eval is not None and spec.metric.task in tasks
          and not (tasks[spec.metric.task] or {}).get("eval")):
        issues.append(RecipeIssue(
            file, lines.get(("metric", "eval")), "metric.eval",
            f"the recipe's task {spec.metric.task!r} runs no in-run eval, so a trial has no "
            f"eval figures: add tasks.{spec.metric.task}.eval: {{every_steps: N}} to the recipe "
            "(or set it in the space's base), or drop metric.eval", spec.metric.eval, True))
    if spec.metric.task is not None and spec.metric.task not in tasks:
        close = difflib.get_close_matches(spec.metric.task, list(tasks), n=1)
        hint = f"; did you mean {close[0]!r}?" if close else ""
        issues.append(RecipeIssue(file, lines.get(("metric", "task")), "metric.task",
                                  f"not a task of the recipe ({', '.join(tasks)}){hint}",
                                  spec.metric.task, True))
    return issues


def _line_map(node: yaml.Node, path: tuple[str, ...], lines: dict[tuple[str, ...], int]) -> None:
    lines.setdefault(path, node.start_mark.line + 1)
    if isinstance(node, yaml.MappingNode):
        for key, value in node.value:
            lines[(*path, str(key.value))] = key.start_mark.line + 1
            _line_map(value, (*path, str(key.value)), lines)


_KNOWN: dict[str, type[BaseModel]] = {
    "": StudyFile, "study": StudyInfo, "hypothesis": Hypothesis, "metric": Metric,
    "budget": Budget, "search": Search, "watchdog": Watchdog, "chaos": Chaos,
}


def _issue(file: str, error: Any, lines: dict[tuple[str, ...], int]) -> RecipeIssue:
    loc = tuple(str(p) for p in error["loc"])
    key = loc
    while key and key not in lines:
        key = key[:-1]
    dotted = ".".join(loc)
    if error["type"] == "extra_forbidden":
        parent = loc[0] if len(loc) == 2 and loc[0] != "space" else ""
        known = list(_KNOWN[parent].model_fields) if parent in _KNOWN else list(Param.model_fields)
        if len(loc) == 1:
            known = list(StudyFile.model_fields)
        close = difflib.get_close_matches(loc[-1], known, n=1)
        hint = f"did you mean {close[0]!r}?" if close else f"known: {', '.join(known)}"
        return RecipeIssue(file, lines.get(key), dotted, f"unknown key; {hint}")
    if error["type"] == "missing":
        return RecipeIssue(file, lines.get(key), dotted, "required: add it")
    message = str(error["msg"]).removeprefix("Value error, ")
    return RecipeIssue(file, lines.get(key), dotted, message, error.get("input"), True)
