"""Write a Python function; it is graded by hidden unit tests in an isolated sandbox.

Each task names a function and states what it must do (`envs/code/problems.py`). The session's
tools: `run_python(code)` runs a script in a fresh sandbox and returns its exit code, stdout
and stderr (at most `max_runs` times); `submit(code)` grades the code once on the hidden cases:
the cases run in one fresh sandbox run, and only their arguments enter the
sandbox, the expected values stay on the host, which compares the JSON results.

Task score = fraction of hidden cases passed by the first submission (0.0 without one).
Levels (`level`, envs/levels.py):

* `hard` (default): the problems of `PROBLEMS`, run_python and submit, 6 model calls; the
  reward is the task score.
* `easy`: one-line functions (`EASY_PROBLEMS`: "Write `def times_five(x)` that returns x
  times 5."), submit only, one model call, after a prior exchange (another one-liner and the
  submit call that solves it); the reward is 0.2 for a well-formed submit + 0.8 * the task
  score, graded by the same hidden cases in the same sandbox.

Sandboxes (`envs/code/sandbox.py`): `backend="auto"` uses a fresh container per run
(`--network none`, read-only, memory/pids/CPU caps, no capabilities, a per-run uid) when an
engine and the image (`images/code`, default `jetctl-code`) are there, else bubblewrap as
root (namespaces, only /usr read-only and the run's directory visible, rlimits, a per-run
uid); `backend="process"` (rlimits, uid drop, `unshare -n`; no file isolation) only when
asked for. `RunResult.backend` / `Grade.backend` says which ran. A node that itself runs in
a container (runtime: docker) reaches the engine through the host's socket when its task
sets `docker_socket: true` (recipes/cocktail.yaml): its sandboxes are sibling containers.

Run: `make_env(backend="auto", image="jetctl-code", time_limit_s=5.0, memory_mb=512,
pids=32, file_mb=8, max_runs=8, level="hard", log_actions=False)`, agent
`agents.code:agent`.
Left out: third-party packages inside the sandbox, problems with float answers, stdin tasks.
"""

from __future__ import annotations

from envs.code.env import CodeEnv, CodeSession, CodeToolError, Grade, grade, make_env
from envs.code.problems import PROBLEMS, Problem
from envs.code.sandbox import Limits, RunResult, SandboxUnavailable, make_sandbox

__all__ = [
    "PROBLEMS",
    "CodeEnv",
    "CodeSession",
    "CodeToolError",
    "Grade",
    "Limits",
    "Problem",
    "RunResult",
    "SandboxUnavailable",
    "grade",
    "make_env",
    "make_sandbox",
]
