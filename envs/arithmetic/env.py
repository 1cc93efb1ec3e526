"""ArithmeticEnv / ArithmeticSession (see the package docstring for the task and reward)."""

from __future__ import annotations

import random
import re
from collections.abc import Iterator
from dataclasses import dataclass, field

from jetctl.env import Task

ANSWER_RE = re.compile(r"<answer>\s*(-?\d+)\s*</answer>", re.IGNORECASE)
EXAMPLE = (3, 4)  # the one-shot example; never asked as a task
QUESTION = "What is {a} + {b}? Answer as <answer>N</answer>."
# The example is a prior exchange in the chat, not text inside the question: measured on
# SmolLM2-135M (16 samples) it made 3/16 first replies well formed; inlined into the
# question, 0-1/16 (and the model then talks about 3 + 4).
EXAMPLE_MESSAGES = (
    {"role": "user", "content": QUESTION.format(a=EXAMPLE[0], b=EXAMPLE[1])},
    {"role": "assistant", "content": f"<answer>{sum(EXAMPLE)}</answer>"},
)
FEEDBACK = "That is not correct. Try again and answer as <answer>N</answer>."

REWARD_FIRST_TURN = 1.0
REWARD_LATER_TURN = 0.6
REWARD_WELL_FORMED = 0.2


def parse_answer(text: str) -> int | None:
    """The integer in the first `<answer>N</answer>` (any case), or None if there is none."""
    match = ANSWER_RE.search(text)
    return int(match.group(1)) if match else None


@dataclass
class ArithmeticSession:
    """One rollout: up to `max_turns` answers; `answer()` returns feedback or None (done)."""

    task: Task
    max_turns: int
    answers: list[str] = field(default_factory=list)
    solved_on_turn: int | None = None
    closed: bool = False

    @property
    def done(self) -> bool:
        return self.solved_on_turn is not None or len(self.answers) >= self.max_turns

    def answer(self, text: str) -> str | None:
        """Submit one reply. Returns the feedback for the next turn, or None when done."""
        if self.done:
            return None
        self.answers.append(text)
        if parse_answer(text) == self.task.data["answer"]:
            self.solved_on_turn = len(self.answers)
            return None
        return None if self.done else FEEDBACK

    def reward(self) -> float:
        if self.solved_on_turn == 1:
            return REWARD_FIRST_TURN
        if self.solved_on_turn is not None:
            return REWARD_LATER_TURN
        if any(parse_answer(a) is not None for a in self.answers):
            return REWARD_WELL_FORMED
        return 0.0

    def close(self) -> None:
        self.closed = True


@dataclass
class ArithmeticEnv:
    """Tasks `a + b` with `digits`-digit operands; ids are `add-<a>+<b>` (stable)."""

    max_turns: int = 2
    digits: int = 1
    seed: int | None = None
    name: str = "arithmetic"

    def __post_init__(self) -> None:
        if self.max_turns < 1:
            raise ValueError(f"max_turns ({self.max_turns}) must be at least 1")
        if not 1 <= self.digits <= 6:
            raise ValueError(f"digits ({self.digits}) must be between 1 and 6")

    def task(self, a: int, b: int) -> Task:
        """The task for `a + b`; `data["messages"]` is the opening chat (example + question)."""
        question = QUESTION.format(a=a, b=b)
        messages = [*map(dict, EXAMPLE_MESSAGES), {"role": "user", "content": question}]
        return Task(
            id=f"add-{a}+{b}",
            prompt=question,
            data={"a": a, "b": b, "answer": a + b, "messages": messages},
        )

    def tasks(self, rng: random.Random) -> Iterator[Task]:
        """Operands drawn uniformly (the example 3 + 4 excluded); with `seed` set, the
        stream comes from `random.Random(seed)` instead of `rng` (same order everywhere)."""
        source = random.Random(self.seed) if self.seed is not None else rng
        high = 10**self.digits - 1
        while True:
            a, b = source.randint(0, high), source.randint(0, high)
            if (a, b) != EXAMPLE:
                yield self.task(a, b)

    def open(self, task: Task) -> ArithmeticSession:
        return ArithmeticSession(task, max_turns=self.max_turns)


def make_env(max_turns: int = 2, digits: int = 1, seed: int | None = None) -> ArithmeticEnv:
    """The arithmetic env (see the package docstring)."""
    return ArithmeticEnv(max_turns=max_turns, digits=digits, seed=seed)
