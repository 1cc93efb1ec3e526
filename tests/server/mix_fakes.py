"""An env and agent for mixing tests: every rollout calls the model once, then pauses
`pause_s` (a slowed task's clients), and scores its reply by a coin of its text, so almost
every group carries signal whatever the model learned."""

from __future__ import annotations

import hashlib
import random
import time
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

from jetctl.env import LLM, Task


@dataclass
class CoinSession:
    task: Task
    reply: str = ""

    def submit(self, text: str) -> None:
        self.reply = text

    def reward(self) -> float:
        return float(hashlib.sha256(self.reply.encode()).digest()[0] % 2)

    def close(self) -> None:
        pass


@dataclass
class CoinEnv:
    pause_s: float = 0.0
    name: str = "coin"

    def tasks(self, rng: random.Random) -> Iterator[Task]:
        while True:
            d = rng.randrange(10)
            yield Task(id=f"coin-{d}", prompt=f"Reply with the digit {d}.",
                       data={"pause_s": self.pause_s})

    def open(self, task: Task) -> CoinSession:
        return CoinSession(task)


def make_env(pause_s: float = 0.0) -> CoinEnv:
    return CoinEnv(pause_s)


def agent(task: Task, llm: LLM, session: Any) -> None:
    reply = llm.client().chat.completions.create(
        model=llm.model, messages=[{"role": "user", "content": task.prompt}], max_tokens=4,
    )
    time.sleep(float(task.data["pause_s"]))
    session.submit(reply.choices[0].message.content or "")
