"""Agent for envs/arithmetic: answer, read the feedback, answer again until done.

The conversation starts from `task.data["messages"]` (the env's one-shot example + question).
Each assistant message is appended to the conversation exactly as the endpoint returned
it, so the client node sees earlier turns as a prefix and reuses their token ids. `agent`
uses the sync openai client, `agent_async` the async one (same behaviour). Run with
`agent = "agents.arithmetic:agent"` (or `:agent_async`).
Left out: tools; a failed call is a failed rollout (no retries).
"""

from __future__ import annotations

from typing import Any

from jetctl.env import LLM, Task

MAX_TOKENS = 24
TEMPERATURE = 1.0


def _assistant_message(response: Any) -> dict[str, Any]:
    """The returned assistant message as a chat message dict (unset fields dropped)."""
    message: dict[str, Any] = response.choices[0].message.model_dump(exclude_none=True)
    return message


def agent(task: Task, llm: LLM, session: Any) -> None:
    """Chat until `session.answer` says the session is done."""
    client = llm.client()
    messages: list[dict[str, Any]] = [dict(m) for m in task.data["messages"]]
    while True:
        response = client.chat.completions.create(
            model=llm.model, messages=messages, max_tokens=MAX_TOKENS, temperature=TEMPERATURE
        )
        reply = _assistant_message(response)
        messages.append(reply)
        feedback = session.answer(reply.get("content") or "")
        if feedback is None:
            return
        messages.append({"role": "user", "content": feedback})


async def agent_async(task: Task, llm: LLM, session: Any) -> None:
    """`agent` over `openai.AsyncOpenAI`."""
    client = llm.async_client()
    messages: list[dict[str, Any]] = [dict(m) for m in task.data["messages"]]
    try:
        while True:
            response = await client.chat.completions.create(
                model=llm.model, messages=messages, max_tokens=MAX_TOKENS, temperature=TEMPERATURE
            )
            reply = _assistant_message(response)
            messages.append(reply)
            feedback = session.answer(reply.get("content") or "")
            if feedback is None:
                return
            messages.append({"role": "user", "content": feedback})
    finally:
        await client.close()
