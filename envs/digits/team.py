"""The digits task for a team: each role is asked for its own digit and scored on its own.

A plumbing task for multi-model teams (`roles:` in the recipe), as fast to learn as the
single-model digits task: with `digits={"seven": 7, "three": 3}` the role `seven` is asked
to reply with 7 and the role `three` with 3, each in the same rollout. `reward()` returns one
reward per role (`score` of that role's reply), so each role's model trains on its own
part with its own reward.

Run: `make_env(digits={"seven": 7, "three": 3}, length=4)`, agent
`agents.digits:team_agent`, and `roles:` naming the same roles.
Left out: roles that depend on each other (see envs/relay for one).
"""

from __future__ import annotations

import random
from collections.abc import Iterator
from dataclasses import dataclass, field

from envs.digits.env import PROMPTS, score
from jetctl.env import Task


@dataclass
class TeamDigitsSession:
    """One rollout: each role's submitted reply; `reward()` scores each role."""

    task: Task
    replies: dict[str, str] = field(default_factory=dict)

    def submit(self, role: str, text: str) -> float:
        """Record `role`'s reply (its first submit counts) and return its reward."""
        digits: dict[str, str] = self.task.data["digits"]
        if role not in digits:
            raise KeyError(f"role {role!r} is not one of this task's roles {sorted(digits)}")
        self.replies.setdefault(role, text)
        return score(self.replies[role], digits[role], int(self.task.data["length"]))

    def reward(self) -> dict[str, float]:
        length = int(self.task.data["length"])
        return {
            role: score(self.replies.get(role, ""), digit, length)
            for role, digit in self.task.data["digits"].items()
        }

    def close(self) -> None:
        pass


@dataclass
class TeamDigitsEnv:
    """Tasks: one prompt variant, the same for every role; ids `team-digits-<variant>`."""

    digits: dict[str, int]
    length: int = 4
    name: str = "team-digits"

    def __post_init__(self) -> None:
        if not self.digits:
            raise ValueError("digits must map at least one role to its digit")
        bad = {role: d for role, d in self.digits.items() if not 0 <= int(d) <= 9}
        if bad:
            raise ValueError(f"each role's digit must be 0-9, got {bad}")
        if self.length < 1:
            raise ValueError(f"length ({self.length}) must be at least 1")

    def all_tasks(self) -> list[Task]:
        tasks = []
        for i, prompt in enumerate(PROMPTS):
            prompts = {role: prompt.format(d=d) for role, d in self.digits.items()}
            tasks.append(Task(
                id=f"team-digits-{i}",
                prompt="; ".join(f"{role}: {text}" for role, text in prompts.items()),
                data={
                    "digits": {role: str(d) for role, d in self.digits.items()},
                    "prompts": prompts,
                    "length": self.length,
                },
            ))
        return tasks

    def tasks(self, rng: random.Random) -> Iterator[Task]:
        tasks = self.all_tasks()
        while True:
            yield rng.choice(tasks)

    def open(self, task: Task) -> TeamDigitsSession:
        return TeamDigitsSession(task)


def make_env(digits: dict[str, int] | None = None, length: int = 4) -> TeamDigitsEnv:
    """Each role of `digits` (default seven: 7, three: 3) asked for its digit."""
    return TeamDigitsEnv(digits=dict(digits or {"seven": 7, "three": 3}), length=length)
