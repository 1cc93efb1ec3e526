"""DigitsEnv / DigitsSession (see the package docstring for the task and reward)."""

from __future__ import annotations

import random
from collections.abc import Iterator
from dataclasses import dataclass, field

from jetctl.env import Task

PROMPTS = (
    "Reply with the digit {d}.",
    "Write the digit {d}, nothing else.",
    "Answer with {d}.",
    "Say {d}.",
)


def score(text: str, digit: str, length: int) -> float:
    """Fraction of the reply that is `digit`, out of at least `length` characters."""
    chars = [c for c in text if not c.isspace()]
    if not chars:
        return 0.0
    return min(1.0, chars.count(digit) / max(length, len(chars)))


@dataclass
class DigitsSession:
    """One rollout: holds the submitted reply; `reward()` scores it (0.0 before a submit)."""

    task: Task
    submitted: str | None = None
    closed: bool = field(default=False)

    def submit(self, text: str) -> float:
        """Record the reply (the first submit counts) and return its reward."""
        if self.submitted is None:
            self.submitted = text
        return self.reward()

    def reward(self) -> float:
        if self.submitted is None:
            return 0.0
        return score(self.submitted, self.task.data["digit"], int(self.task.data["length"]))

    def close(self) -> None:
        self.closed = True


@dataclass
class DigitsEnv:
    """Tasks: the prompt variants for one digit; ids are `digits-<digit>-<variant>`."""

    digit: int = 7
    length: int = 4
    name: str = "digits"

    def __post_init__(self) -> None:
        if not 0 <= self.digit <= 9:
            raise ValueError(f"digit ({self.digit}) must be a single digit 0-9")
        if self.length < 1:
            raise ValueError(f"length ({self.length}) must be at least 1")

    def all_tasks(self) -> list[Task]:
        """Every task, in a fixed order."""
        return [
            Task(
                id=f"digits-{self.digit}-{i}",
                prompt=p.format(d=self.digit),
                data={"digit": str(self.digit), "length": self.length},
            )
            for i, p in enumerate(PROMPTS)
        ]

    def tasks(self, rng: random.Random) -> Iterator[Task]:
        tasks = self.all_tasks()
        while True:
            yield rng.choice(tasks)

    def open(self, task: Task) -> DigitsSession:
        return DigitsSession(task)


def make_env(digit: int = 7, length: int = 4) -> DigitsEnv:
    """The digits env: reply with `digit`, scored over `length` characters."""
    return DigitsEnv(digit=digit, length=length)
