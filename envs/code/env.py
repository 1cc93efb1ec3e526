"""CodeEnv / CodeSession (see the package docstring for the task, levels and reward)."""

from __future__ import annotations

import json
import random
import secrets
from collections.abc import Iterator
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any, Literal

from envs.code.problems import EASY_EXAMPLE, EASY_PROBLEMS, PROBLEMS, Problem
from envs.code.sandbox import DEFAULT_IMAGE, Limits, RunResult, Sandbox, make_sandbox
from envs.levels import (
    ActionLog,
    Level,
    LevelledSession,
    check_level,
    easy_reward,
    example_call,
)
from jetctl.env import Task

HARNESS = (Path(__file__).parent / "harness.py").read_text()
PROMPT = (
    "Write a Python function `{signature}`.\n{statement}\n"
    "Use the run_python tool to try code (it prints stdout and stderr), then call submit "
    "with the complete solution (standard library only). Hidden tests score the submission."
)
HARD_SYSTEM = (
    "You write Python. Test ideas with run_python, which runs a script and shows its output. "
    "Call submit once with the complete solution; hidden tests grade it."
)
EASY_SYSTEM = "You write Python functions."
EASY_PROMPT = "Write `{signature}` that {statement}. Call submit."
TOOLS_BY_LEVEL: dict[Level, tuple[str, ...]] = {
    "easy": ("submit",),
    "hard": ("run_python", "submit"),
}
MAX_STEPS_BY_LEVEL: dict[Level, int] = {"easy": 1, "hard": 6}
EASY_EXAMPLE_MESSAGES = (
    {"role": "user",
     "content": EASY_PROMPT.format(signature=EASY_EXAMPLE.signature,
                                   statement=EASY_EXAMPLE.statement)},
    example_call("submit", code=EASY_EXAMPLE.reference.strip()),
)  # fmt: skip
ALL_PROBLEMS = {p.id: p for p in (*PROBLEMS, *EASY_PROBLEMS)}


class CodeToolError(ValueError):
    """A tool call the session refuses (reported to the model as the tool's result)."""


@dataclass(frozen=True)
class Grade:
    passed: int
    total: int
    backend: str
    timed_out: bool


def _json_normal(value: Any) -> Any:
    """The value as it looks after a JSON round trip (tuples become lists)."""
    return json.loads(json.dumps(value))


def grade(sandbox: Sandbox, problem: Problem, code: str, limits: Limits) -> Grade:
    """Run the hidden cases on `code` in a fresh sandbox; the expected values stay here."""
    marker = f"@@case-{secrets.token_hex(8)}@@"
    cases = {
        "function": problem.function,
        "cases": [list(args) for args, _ in problem.cases],
        "case_time_s": max(0.1, limits.time_s / 2),
        "marker": marker,
    }
    files = {"solution.py": code, "_harness.py": HARNESS, "_cases.json": json.dumps(cases)}
    # room for every case's line; the run's file limit still caps what is written
    run = sandbox.run(files, ["_harness.py"], replace(limits, output_chars=1_000_000))
    results: dict[int, Any] = {}
    for line in run.stdout.splitlines():
        if not line.startswith(marker + " "):
            continue
        try:
            row = json.loads(line[len(marker) + 1 :])
        except json.JSONDecodeError:
            continue  # a line the solution forged badly; it scores nothing
        if isinstance(row, dict) and isinstance(row.get("i"), int) and "result" in row:
            results.setdefault(row["i"], row["result"])  # the first line per case counts
    passed = sum(
        1
        for i, (_, expected) in enumerate(problem.cases)
        if i in results and results[i] == _json_normal(expected)
    )
    return Grade(passed, len(problem.cases), run.backend, run.timed_out)


def format_run(run: RunResult) -> str:
    if run.timed_out:
        head = f"killed at the time limit after {run.wall_s:.1f}s"
    else:
        head = f"exit code {run.exit_code}"
    return f"{head}\n--- stdout ---\n{run.stdout}\n--- stderr ---\n{run.stderr}"


@dataclass
class CodeSession(LevelledSession):
    """One rollout: `run_python(code)` to try code, `submit(code)` once to be graded."""

    tools_by_level = TOOLS_BY_LEVEL
    max_steps_by_level = MAX_STEPS_BY_LEVEL

    task: Task
    sandbox: Sandbox
    limits: Limits
    max_runs: int
    level: Level = "hard"
    log_actions: bool = False
    runs: list[RunResult] = field(default_factory=list)
    graded: Grade | None = None
    closed: bool = False

    def __post_init__(self) -> None:
        self.actions = ActionLog("code", self.level, self.task.id)

    @property
    def problem(self) -> Problem:
        return ALL_PROBLEMS[self.task.data["problem"]]

    @property
    def done(self) -> bool:
        return self.graded is not None

    def opening(self) -> list[dict[str, Any]]:
        """The conversation the agent starts from (easy: after the prior exchange)."""
        if self.level == "hard":
            return [
                {"role": "system", "content": HARD_SYSTEM},
                {"role": "user", "content": self.task.prompt},
            ]
        return [
            {"role": "system", "content": EASY_SYSTEM},
            *map(dict, EASY_EXAMPLE_MESSAGES),
            {"role": "user", "content": self.task.prompt},
        ]

    def run_python(self, code: str) -> str:
        """Run `code` as a script in a fresh sandbox; returns exit code, stdout and stderr."""
        if len(self.runs) >= self.max_runs:
            e = CodeToolError(f"run limit reached ({self.max_runs} runs); submit now")
            self.actions.record("run_python", {"code": code}, f"error: {e}")
            raise e
        run = self.sandbox.run({"main.py": code}, ["main.py"], self.limits)
        self.runs.append(run)
        result = format_run(run)
        self.actions.record("run_python", {"code": code}, result)
        return result

    def submit(self, code: str) -> str:
        """Grade `code` on the hidden tests (the first submission counts)."""
        if self.graded is not None:
            e = CodeToolError("already submitted; only the first submission counts")
            self.actions.record("submit", {"code": code}, f"error: {e}")
            raise e
        self.graded = grade(self.sandbox, self.problem, code, self.limits)
        g = self.graded
        result = f"submitted: {g.passed} of {g.total} hidden tests passed (sandbox: {g.backend})"
        self.actions.record("submit", {"code": code}, result)
        return result

    def task_score(self) -> float:
        """Fraction of hidden tests passed by the submission (0.0 without one)."""
        if self.graded is None:
            return 0.0
        return self.graded.passed / self.graded.total

    def reward(self) -> float:
        """Hard: the task score. Easy: 0.2 for a well-formed action + 0.8 * the task score."""
        if self.level == "hard":
            return self.task_score()
        return easy_reward(self.task_score(), self.actions.well_formed, self.max_steps)

    def close(self) -> None:
        if not self.closed and self.log_actions:
            self.actions.dump(self.reward())
        self.closed = True


@dataclass
class CodeEnv:
    """One task per problem of the level (`envs.code.problems`); ids are `code-<problem id>`."""

    backend: Literal["auto", "docker", "bwrap", "process"] = "auto"
    image: str = DEFAULT_IMAGE
    limits: Limits = field(default_factory=Limits)
    max_runs: int = 8
    level: Level = "hard"
    log_actions: bool = False
    name: str = "code"
    _sandbox: Sandbox | None = field(default=None, init=False, repr=False)

    def __post_init__(self) -> None:
        if self.max_runs < 0:
            raise ValueError(f"max_runs ({self.max_runs}) must be at least 0")
        self.level = check_level(self.level)

    @property
    def sandbox(self) -> Sandbox:
        """The backend, chosen on first use (raises SandboxUnavailable saying what to install)."""
        if self._sandbox is None:
            self._sandbox = make_sandbox(self.backend, self.image)
        return self._sandbox

    def all_tasks(self) -> list[Task]:
        if self.level == "easy":
            return [
                Task(
                    id=f"code-{p.id}",
                    prompt=EASY_PROMPT.format(signature=p.signature, statement=p.statement),
                    data={"problem": p.id, "function": p.function, "level": "easy"},
                )
                for p in EASY_PROBLEMS
            ]
        return [
            Task(
                id=f"code-{p.id}",
                prompt=PROMPT.format(signature=p.signature, statement=p.statement),
                data={"problem": p.id, "function": p.function},
            )
            for p in PROBLEMS
        ]

    def tasks(self, rng: random.Random) -> Iterator[Task]:
        tasks = self.all_tasks()
        while True:
            yield rng.choice(tasks)

    def open(self, task: Task) -> CodeSession:
        if task.data.get("level", "hard") != self.level:
            raise ValueError(f"task {task.id} is not a task of the {self.level} level")
        return CodeSession(task, self.sandbox, self.limits, self.max_runs, level=self.level,
                           log_actions=self.log_actions)  # fmt: skip


def make_env(
    backend: Literal["auto", "docker", "bwrap", "process"] = "auto",
    image: str = DEFAULT_IMAGE,
    time_limit_s: float = 5.0,
    memory_mb: int = 512,
    pids: int = 32,
    file_mb: int = 8,
    max_runs: int = 8,
    level: Level = "hard",
    log_actions: bool = False,
) -> CodeEnv:
    """The code env (see the package docstring)."""
    limits = Limits(time_s=time_limit_s, memory_mb=memory_mb, pids=pids, file_mb=file_mb)
    return CodeEnv(backend=backend, image=image, limits=limits, max_runs=max_runs, level=level,
                   log_actions=log_actions)  # fmt: skip
