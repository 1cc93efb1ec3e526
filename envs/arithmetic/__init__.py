"""Multi-turn addition answered as `<answer>N</answer>`: the quickstart task for SmolLM2.

The chat opens with a one-shot example exchange (user: "What is 3 + 4? Answer as
<answer>N</answer>.", assistant: `<answer>7</answer>`) and then the question `a + b`
(single digits by default), all in `task.data["messages"]` (`task.prompt` is the question
alone). Without the example the base model is never well formed (0 of 32 samples, measured). The agent sends each reply to `session.answer(text)`: it returns `None` when the
session is done (correct, or out of turns) or feedback text to send as the next user
message ("That is not correct. Try again and answer as <answer>N</answer>.").

Reward, dense and checked by code (`<answer>` parsed case-insensitively, first tag counts):
1.0 correct on turn 1, 0.6 correct on a later turn, 0.2 well formed but never correct,
0.0 otherwise.

Run: `make_env(max_turns=2, digits=1, seed=None)`, agent `agents.arithmetic:agent`.
Left out: other operations, and partial credit for near misses.
"""

from __future__ import annotations

from envs.arithmetic.env import (
    ArithmeticEnv,
    ArithmeticSession,
    make_env,
    parse_answer,
)

__all__ = ["ArithmeticEnv", "ArithmeticSession", "make_env", "parse_answer"]
