"""A digits agent whose reward is noise: it calls the model, then prefixes the reply with a
random number of 7s (0-4, from os.urandom) before submitting it.

The tiny random model almost never writes a 7 at first, so on plain digits a run can go
minutes without a group whose rewards differ, i.e. without a GRPO step. Plumbing tests
(faults, chaos) need steps from the first batch on: this agent gives every group reward
variance while its trajectories still carry real model calls. It learns nothing useful.
Run it with `agent = "agents.noisy:agent"` on envs/digits.
"""

from __future__ import annotations

import os
from typing import Any

from jetctl.env import LLM, Task


def agent(task: Task, llm: LLM, session: Any) -> None:
    """One call; `session.submit("7" * k + reply)` with k uniform in 0..4."""
    response = llm.client().chat.completions.create(
        model=llm.model,
        messages=[{"role": "user", "content": task.prompt}],
        max_tokens=int(task.data["length"]),
        temperature=1.0,
    )
    sevens = os.urandom(1)[0] % 5
    session.submit("7" * sevens + (response.choices[0].message.content or ""))
