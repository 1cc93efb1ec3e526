"""A digits agent that sometimes never returns: it starts a helper process and loops forever.

Shows that `rollout_timeout_s` kills a stuck rollout together with everything it started
(its process group), records it as `timeout`, and that the node keeps working. Each rollout
gets stuck with probability `JETCTL_STUCK_FRACTION` (default 0.25, drawn from os.urandom, so
forked rollouts do not share a draw). A stuck rollout writes its helper's pid into
`$JETCTL_STUCK_PID_DIR/<pid>` (when set) so a test can check that the helper died too.
Run it with `agent = "agents.stuck:agent"` on envs/digits.
"""

from __future__ import annotations

import os
import subprocess
import time
from typing import Any

from agents.noisy import agent as noisy_agent
from jetctl.env import LLM, Task


def agent(task: Task, llm: LLM, session: Any) -> None:
    """The noisy digits agent (rewards vary, so the server steps); then, on some rollouts,
    a helper process and a loop that never ends."""
    noisy_agent(task, llm, session)
    fraction = float(os.environ.get("JETCTL_STUCK_FRACTION", "0.25"))
    if int.from_bytes(os.urandom(2), "big") / 65536 >= fraction:
        return
    helper = subprocess.Popen(["sleep", "3600"])  # stands in for a browser or a shell
    pid_dir = os.environ.get("JETCTL_STUCK_PID_DIR")
    if pid_dir:
        with open(os.path.join(pid_dir, str(helper.pid)), "w") as f:
            f.write(str(helper.pid))
    while True:  # an agent waiting on an environment that will never answer
        time.sleep(0.2)
