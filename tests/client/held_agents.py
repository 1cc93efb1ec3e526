"""Agents for tests/client/test_rollout_held.py: one that takes a while and calls no model."""

from __future__ import annotations

import time
from typing import Any

from jetctl.env import LLM, Task

SLEEP_S = 2.0


def slow_agent(task: Task, llm: LLM, session: Any) -> None:
    time.sleep(SLEEP_S)
