"""A deliberately slow digits agent: it answers, then dawdles until training has moved on.

It makes its call, submits the reply, then keeps probing the model with one-token calls
until the version in the response (`system_fingerprint` is `jetctl-v<version>`) is
`JETCTL_SLOW_AGENT_LAG` (default 3) versions past its first call. Its group therefore
reaches the server with a lag above a `max_staleness` below that, and is refused as
stale, however fast or slow the machine is. Tests use it to show the staleness gate.
"""

from __future__ import annotations

import os
import time
from typing import Any

from jetctl.env import LLM, Task


def _version(response: Any) -> int:
    return int(str(response.system_fingerprint).rsplit("-v", 1)[1])


def agent(task: Task, llm: LLM, session: Any) -> None:
    client = llm.client()
    messages = [{"role": "user", "content": task.prompt}]
    first = client.chat.completions.create(
        model=llm.model, messages=messages, max_tokens=int(task.data["length"]), temperature=1.0
    )
    session.submit(first.choices[0].message.content or "")
    target = _version(first) + int(os.environ.get("JETCTL_SLOW_AGENT_LAG", "3"))
    while True:  # the node's rollout timeout bounds this loop
        time.sleep(0.5)
        probe = client.chat.completions.create(model=llm.model, messages=messages, max_tokens=1)
        if _version(probe) >= target:
            return
