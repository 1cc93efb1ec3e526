"""RelayEnv / RelaySession (see the package docstring for the task and rewards)."""

from __future__ import annotations

import random
import re
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

from envs.levels import example_call
from jetctl.env import Task

EXAMPLE = (3, 4)  # the prior exchange's operands; never asked as a task
QUESTION = "What is {a} + {b}? Call the add tool with the two numbers."
TOOLS: list[dict[str, Any]] = [
    {
        "type": "function",
        "function": {
            "name": "add",
            "description": "Add two integers.",
            "parameters": {
                "type": "object",
                "properties": {"a": {"type": "integer"}, "b": {"type": "integer"}},
                "required": ["a", "b"],
            },
        },
    }
]
ANSWER_PROMPT = "{result} Reply with the result."
REWARD_RIGHT_CALL = 1.0
REWARD_WELL_FORMED = 0.2
REWARD_RIGHT_ANSWER = 1.0  # the sum and nothing else ("7", "7.")
REWARD_ANSWER_IN_WORDS = 0.2  # the sum as a number among other words ("The result is 7.")


def answer_score(reply: str, total: int) -> float:
    """The answerer's reward: 1.0 for the sum alone, 0.2 for the sum among other words."""
    if reply.strip().rstrip(".").strip() == str(total):
        return REWARD_RIGHT_ANSWER
    if re.search(rf"(?<![\d.]){total}(?![\d]|\.\d)", reply):
        return REWARD_ANSWER_IN_WORDS
    return 0.0


def answer_messages(result: str) -> list[dict[str, str]]:
    """The answerer's conversation: one prior exchange (the example's result, answered with
    the number alone), then what the tool returned in this rollout."""
    example = f"add returned {sum(EXAMPLE)}."
    return [
        {"role": "user", "content": ANSWER_PROMPT.format(result=example)},
        {"role": "assistant", "content": str(sum(EXAMPLE))},
        {"role": "user", "content": ANSWER_PROMPT.format(result=result)},
    ]


def _operands(arguments: object) -> tuple[int, int] | None:
    """(a, b) of an add call's arguments when both are integers (a model may write "3")."""
    if not isinstance(arguments, dict):
        return None
    out = []
    for key in ("a", "b"):
        value = arguments.get(key)
        if isinstance(value, str) and value.strip().lstrip("-").isdigit():
            value = int(value)
        if not isinstance(value, int) or isinstance(value, bool):
            return None
        out.append(value)
    return out[0], out[1]


@dataclass
class RelaySession:
    """One rollout: the caller's add call (`add`), then the answerer's reply (`answer`)."""

    task: Task
    operands: tuple[int, int] | None = None  # of the caller's first well-formed add call
    result: str = "add was not called."  # what the answerer is shown
    reply: str | None = None

    def add(self, arguments: object) -> str:
        """Run the caller's add call; returns the tool's result (what the answerer sees)."""
        operands = _operands(arguments)
        if operands is None:
            self.result = "add failed: it takes two integers a and b."
        elif self.operands is None:
            self.operands = operands
            self.result = f"add returned {sum(operands)}."
        return self.result

    def answer(self, text: str) -> None:
        """The answerer's reply (the first one counts)."""
        if self.reply is None:
            self.reply = text

    def reward(self) -> dict[str, float]:
        a, b = self.task.data["operands"]
        if self.operands is None:
            caller = 0.0
        elif sorted(self.operands) == sorted((a, b)):
            caller = REWARD_RIGHT_CALL
        else:
            caller = REWARD_WELL_FORMED
        return {"caller": caller, "answerer": answer_score(self.reply or "", a + b)}

    def close(self) -> None:
        pass


@dataclass
class RelayEnv:
    """Tasks `a + b` (a + b <= 9); ids `relay-<a>+<b>` (stable)."""

    name: str = "relay"

    def all_tasks(self) -> list[Task]:
        return [self._task(a, b) for a in range(10) for b in range(10 - a) if (a, b) != EXAMPLE]

    def _task(self, a: int, b: int) -> Task:
        question = QUESTION.format(a=a, b=b)
        messages = [
            {"role": "user", "content": QUESTION.format(a=EXAMPLE[0], b=EXAMPLE[1])},
            example_call("add", a=EXAMPLE[0], b=EXAMPLE[1]),
            {"role": "user", "content": question},
        ]
        return Task(
            id=f"relay-{a}+{b}",
            prompt=question,
            data={"operands": [a, b], "messages": messages},
        )

    def tasks(self, rng: random.Random) -> Iterator[Task]:
        tasks = self.all_tasks()
        while True:
            yield rng.choice(tasks)

    def open(self, task: Task) -> RelaySession:
        return RelaySession(task)


def make_env() -> RelayEnv:
    """The relay env (it takes no env_args)."""
    return RelayEnv()
