"""A digits agent that crashes on some tasks: shows a crashing agent becomes a `failed`
trajectory while the node keeps working.

Whether a rollout crashes depends only on the task id (sha256 bucket < `CRASH_FRACTION`),
so tests know in advance: `crashes("digits-7-0")` is True and `crashes("digits-7-1")` is
False for the digits env's ids. It crashes *after* its LLM call, so the failed trajectory
has a recorded call. Run it with `agent = "agents.crashy:agent"` on envs/digits.
"""

from __future__ import annotations

import hashlib
from typing import Any

from agents.digits import agent as digits_agent
from jetctl.env import LLM, Task

CRASH_FRACTION = 0.5


class DeliberateCrash(RuntimeError):
    """Raised by the crashy agent on purpose."""


def crashes(task_id: str, fraction: float = CRASH_FRACTION) -> bool:
    """True when the agent crashes on this task id (deterministic, stable across runs)."""
    bucket = int.from_bytes(hashlib.sha256(task_id.encode()).digest()[:8], "big") / 2**64
    return bucket < fraction


def agent(task: Task, llm: LLM, session: Any) -> None:
    """The digits agent, then a `DeliberateCrash` when `crashes(task.id)`."""
    digits_agent(task, llm, session)
    if crashes(task.id):
        raise DeliberateCrash(f"crashy agent: deliberate crash on task {task.id}")
