"""The digits task: "Reply with the digit 7", scored by how much of the reply is that digit.

The fast-learning task for `builtin:tiny` (measured on 2 CPU cores: the random tiny Llama
learns it by RL alone in ~50-100 steps). The agent submits its reply text once with `session.submit(text)`; the
reward is dense and checked by code:

    reward = (number of target digits in the reply) / max(length, non-space characters)

so with `length` (default 4) completion tokens, "7777" scores 1.0, "77" 0.5 and "7ab!" 0.25.
`builtin:tiny` tokenizes every digit as a token of its own, so this equals the fraction of
completion tokens that are the digit when the agent asks for `length` tokens.

Run: `make_env(digit=7, length=4)`, agent `agents.digits:agent`.
Left out: any task where the prompt matters (every prompt asks for the same digit).
"""

from __future__ import annotations

from envs.digits.env import DigitsEnv, DigitsSession, make_env, score

__all__ = ["DigitsEnv", "DigitsSession", "make_env", "score"]
