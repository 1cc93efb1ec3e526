"""Difficulty levels of the tool-calling envs (web, code, api): `env_args: {level: ...}`.

    easy   a task a 135M model gets reward signal on: the real machinery (a real page in
           headless Chromium, a real sandbox run, a real rate-limited API with a credential),
           a horizon of one or two actions, few tools, the expected action shown by one
           prior exchange in the conversation, and partial credit for well-formed actions:

               reward = 0.2 * (well-formed actions / action budget) + 0.8 * task score

    hard   the full task for GPU-size models: every tool, a long horizon, no example, and
           the task score alone (each env's docstring says what it scores).

A well-formed action is a tool call the agent could run: a tool the level offers, with
arguments of the right names (`agents.tool_loop.call_tool` checks them before the session
sees the call). A call the environment then refuses (no such element, run limit reached)
is still well formed: the model acted, the world said no.

The prior exchange shows the expected call and not its result: measured on SmolLM2-135M
(16 samples at temperature 1, `/work` notes in the closing note of issue 13), an example
followed by the tool's result made the model write a `<tool_response>` of its own in every
sample, and none wrote a call; the call alone gave 11 of 16 well-formed calls.

Each session can also print what it did (`log_actions=True`): one JSON line on stderr
at close, `{"actions": {env, level, task, steps: [{tool, args, result}], reward}}`, which
a client node keeps in its log; the closing note's decoded trajectories come from there.
"""

from __future__ import annotations

import json
import sys
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any, ClassVar, Literal, TextIO

Level = Literal["easy", "hard"]
LEVELS: tuple[Level, ...] = ("easy", "hard")
WELL_FORMED_WEIGHT = 0.2  # the share of an easy reward that well-formed actions earn
RESULT_CHARS = 300  # of each action's result kept in the action log


class LevelledSession:
    """`tool_names` and `max_steps` of an env's session, from its env's tables per level."""

    level: Level
    tools_by_level: ClassVar[Mapping[Level, tuple[str, ...]]]
    max_steps_by_level: ClassVar[Mapping[Level, int]]

    @property
    def tool_names(self) -> tuple[str, ...]:
        """The tools this level offers the agent."""
        return self.tools_by_level[self.level]

    @property
    def max_steps(self) -> int:
        """Model calls the agent may make."""
        return self.max_steps_by_level[self.level]


def check_level(level: str) -> Level:
    """`level` as a Level, or a ValueError that names the choices."""
    if level not in LEVELS:
        raise ValueError(f"level ({level!r}) must be one of {', '.join(LEVELS)}")
    return level  # type: ignore[return-value]  # checked against LEVELS just above


def example_call(name: str, **arguments: Any) -> dict[str, Any]:
    """An assistant message with one tool call, for a level's prior exchange.

    OpenAI's shape, so the served model's chat template renders it in that model's own
    tool-call format (the agent never spells a format out)."""
    return {
        "role": "assistant",
        "content": "",
        "tool_calls": [
            {
                "id": f"call_example_{name}",
                "type": "function",
                "function": {"name": name, "arguments": json.dumps(arguments)},
            }
        ],
    }


def easy_reward(score: float, well_formed: int, budget: int) -> float:
    """0.2 for well-formed actions (a share per action of the budget) + 0.8 * score."""
    form = min(well_formed, budget) / budget if budget > 0 else 0.0
    return WELL_FORMED_WEIGHT * form + (1.0 - WELL_FORMED_WEIGHT) * score


@dataclass
class ActionLog:
    """The tool calls a session ran, in order, with the start of each result."""

    env: str
    level: Level
    task: str
    steps: list[dict[str, Any]] = field(default_factory=list)

    def record(self, tool: str, args: dict[str, Any], result: str) -> None:
        self.steps.append({"tool": tool, "args": args, "result": result[:RESULT_CHARS]})

    @property
    def well_formed(self) -> int:
        """Actions the session received: every one passed the agent's argument check."""
        return len(self.steps)

    def dump(self, reward: float, stream: TextIO | None = None) -> None:
        """One JSON line: `{"actions": {env, level, task, steps, reward}}`."""
        line = {"env": self.env, "level": self.level, "task": self.task,
                "steps": self.steps, "reward": reward}  # fmt: skip
        out = stream if stream is not None else sys.stderr
        out.write(json.dumps({"actions": line}, ensure_ascii=False) + "\n")
        out.flush()
