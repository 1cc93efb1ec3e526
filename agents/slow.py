"""A deliberately slow digits agent: it calls the model, then dawdles before answering.

Its calls carry the model version of when they were made; by the time the group reaches
the server, training has moved on, so the group is refused as stale. Tests use it to
show the staleness gate; `JETCTL_SLOW_AGENT_S` sets the delay (default 8 s).
"""

from __future__ import annotations

import os
import time
from typing import Any

from agents.digits import agent as digits_agent
from jetctl.env import LLM, Task


def agent(task: Task, llm: LLM, session: Any) -> None:
    digits_agent(task, llm, session)
    time.sleep(float(os.environ.get("JETCTL_SLOW_AGENT_S", "8")))
