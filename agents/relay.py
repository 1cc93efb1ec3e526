"""Agent for envs/relay: the caller calls add, the answerer reads the result and answers.

Two roles of one team, named as `model=` (the recipe's `roles:` maps them to models):
`caller` gets the conversation of `task.data["messages"]` with the add tool and its first
add call is run by the session; `answerer` gets only the tool's result (after one prior
exchange, `envs.relay.answer_messages`) and its reply, at most ANSWER_MAX_TOKENS tokens, is
the team's answer. The answerer is always asked, also when the caller made no call (it is
then told so, and cannot be right). Run with `agent = "agents.relay:agent"`.
Left out: retries and a second try after a failed call.
"""

from __future__ import annotations

import json
from typing import Any

from envs.relay import TOOLS, answer_messages
from jetctl.env import LLM, Task

ROLES = ("caller", "answerer")
ANSWER_MAX_TOKENS = 8  # room for "The result is 7." (0.2); the right answer is one token


def _add_arguments(message: Any) -> object:
    """The arguments of the first add call of an assistant message (None: no such call)."""
    for call in message.tool_calls or []:
        if call.function.name == "add":
            try:
                return json.loads(call.function.arguments or "{}")
            except json.JSONDecodeError:
                return None
    return None


def agent(task: Task, llm: LLM, session: Any) -> None:
    missing = [r for r in ROLES if r not in llm.roles]
    if missing:
        raise ValueError(
            f"the relay agent needs roles {', '.join(ROLES)}; this task has "
            f"{', '.join(llm.roles) or 'none'}: name them under roles: in the recipe"
        )
    client = llm.client()
    first = client.chat.completions.create(
        model="caller", messages=task.data["messages"], tools=TOOLS
    )
    arguments = _add_arguments(first.choices[0].message)
    if arguments is not None:
        session.add(arguments)
    second = client.chat.completions.create(
        model="answerer",
        messages=answer_messages(session.result),
        max_tokens=ANSWER_MAX_TOKENS,
    )
    session.answer(second.choices[0].message.content or "")
