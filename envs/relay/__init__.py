"""Relay: a team of two models answers "What is a + b?" together; neither can alone.

    caller    reads the question and calls the `add` tool with its operands. It needs a
              chat model that writes tool calls (SmolLM2-135M-Instruct: 11 of 16 calls well
              formed with one prior exchange showing a call).
    answerer  is shown only what the tool returned ("add returned 7.") and replies with the
              result. Copying a digit is within reach of builtin:tiny, trained by RL alone.

Rewards, one per role (`reward()` returns both, so each model trains on its own part):

    caller    1.0 for add with the question's operands (either order), 0.2 for a well-formed
              add call with other integers, 0 without one
    answerer  the fraction of its reply that is the true sum's digit, over `length`
              characters (as envs/digits scores): 1.0 for "7777" when a + b = 7

The answerer is scored against the true sum, not against what the tool returned: it can be
right only when the caller did its part, so the team's answer is right only when both did.
Operands are 0-9 with a sum of at most 9 (one digit: builtin:tiny reads each digit as a token
of its own); 3 + 4 is the prior exchange's example and never asked.

Run: `make_env(length=4)`, agent `agents.relay:agent`, roles `caller` and `answerer`
(recipes/team.yaml).
Left out: multi-digit sums, other operations.
"""

from __future__ import annotations

from envs.relay.env import TOOLS, RelayEnv, RelaySession, make_env

__all__ = ["TOOLS", "RelayEnv", "RelaySession", "make_env"]
