"""Relay: a team of two models answers "What is a + b?" together; neither can alone.

    caller    reads the question and calls the `add` tool with its operands. It needs a
              chat model that writes tool calls (SmolLM2-135M-Instruct: 11 of 16 calls well
              formed with one prior exchange showing a call).
    answerer  is shown only what the tool returned ("add returned 7. Reply with the
              result."), after one prior exchange answered with the number alone, and
              replies with the result (`answer_messages`).

Rewards, one per role (`reward()` returns both, so each model trains on its own part):

    caller    1.0 for add with the question's operands (either order), 0.2 for a well-formed
              add call with other integers, 0 without one
    answerer  1.0 for the true sum alone ("7", "7."), 0.2 for the sum among other words
              ("The result is 7."), 0 otherwise (`answer_score`)

The answerer is scored against the true sum, not against what the tool returned: it can be
right only when the caller did its part, so the team's answer is right only when both did.
Operands are 0-9 with a sum of at most 9; 3 + 4 is the prior exchanges' example and never
asked. Measured on SmolLM2-135M-Instruct at temperature 1 before training (24 samples
each): the caller 0.55; the answerer 0.45 with the prior exchange, and without it the right
number in 3 of 24 replies, never alone, hence the example. recipes/team.yaml's header has a
run's figures.

Run: `make_env()`, agent `agents.relay:agent`, roles `caller` and `answerer`
(recipes/team.yaml).
Left out: multi-digit sums, other operations.
"""

from __future__ import annotations

from envs.relay.env import TOOLS, RelayEnv, RelaySession, answer_messages, answer_score, make_env

__all__ = ["TOOLS", "RelayEnv", "RelaySession", "answer_messages", "answer_score", "make_env"]
