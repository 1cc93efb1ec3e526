"""A digits agent whose reward is noise: it calls the model, then submits the reply with a
random number of 7s (0-4) before it and a random number of 0s (0-4) after it, both from
os.urandom.

The tiny random model almost never writes a 7 at first, so on plain digits a run can go
minutes without a group whose rewards differ, i.e. without a GRPO step. Plumbing tests
(faults, chaos) need steps from the first batch on and for as long as they run: this agent
gives every group reward variance while its trajectories still carry real model calls.

Both ends are needed. With 7s before the reply only, the reward, (7s) / max(length,
characters), is 1.0 for every member once the model has learnt to write nothing but 7s
(on a fast CPU within about 90 s at the fault tests' learning rate): no group has variance, no
step is taken, no checkpoint is written, and a chaos run waiting for one times out. The 0s
after the reply keep the denominator moving then; the 7s before it keep the numerator moving
while the model writes none. It learns nothing useful.
Run it with `agent = "agents.noisy:agent"` on envs/digits.
"""

from __future__ import annotations

import os
from typing import Any

from jetctl.env import LLM, Task


def agent(task: Task, llm: LLM, session: Any) -> None:
    """One call; `session.submit("7" * a + reply + "0" * b)`, a and b uniform in 0..4."""
    response = llm.client().chat.completions.create(
        model=llm.model,
        messages=[{"role": "user", "content": task.prompt}],
        max_tokens=int(task.data["length"]),
        temperature=1.0,
    )
    noise = os.urandom(2)
    sevens, zeros = noise[0] % 5, noise[1] % 5
    session.submit("7" * sevens + (response.choices[0].message.content or "") + "0" * zeros)
