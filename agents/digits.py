"""Agent for envs/digits: one chat completion, submitted as the answer.

Asks for `task.data["length"]` tokens at temperature 1 (exploration for RL) and submits
the text; the session scores it. Run it with `agent = "agents.digits:agent"`.
`team_agent` is the same for envs/digits/team.py: one call per role (`model=` the role's
name, from `llm.roles`), each reply submitted as that role's.
Left out: retries (a failed call is a failed rollout, which is data).
"""

from __future__ import annotations

from typing import Any

from jetctl.env import LLM, Task


def agent(task: Task, llm: LLM, session: Any) -> None:
    """One call; `session.submit(reply)`."""
    response = llm.client().chat.completions.create(
        model=llm.model,
        messages=[{"role": "user", "content": task.prompt}],
        max_tokens=int(task.data["length"]),
        temperature=1.0,
    )
    session.submit(response.choices[0].message.content or "")


def team_agent(task: Task, llm: LLM, session: Any) -> None:
    """One call per role of the team, in the order of `llm.roles`."""
    client = llm.client()
    for role in llm.roles:
        response = client.chat.completions.create(
            model=role,
            messages=[{"role": "user", "content": task.data["prompts"][role]}],
            max_tokens=int(task.data["length"]),
            temperature=1.0,
        )
        session.submit(role, response.choices[0].message.content or "")
