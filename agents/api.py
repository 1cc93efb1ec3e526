"""Tool-calling agent for envs/api: call the REST API until the answer is submitted.

One tool, http(method, path, body) (the session's `http`; credentials and rate-limit waits
are handled there, see envs/api). `body` may be a JSON object or a JSON string. The loop is
`agents.tool_loop.run_tool_loop`; it ends once the task is answered, when the model answers
without a tool call, or after MAX_STEPS model calls. Run with `agent = "agents.api:agent"`.
Left out: an async variant.
"""

from __future__ import annotations

import json
from typing import Any

from agents.tool_loop import Tool, run_tool_loop, text_arg
from envs.api import ApiSession, ApiToolError
from jetctl.env import LLM, Task

MAX_STEPS = 16
MAX_TOKENS = 256
TEMPERATURE = 1.0
SYSTEM = "You answer questions by calling a JSON REST API with the http tool."


def tools_for(session: ApiSession) -> list[Tool]:
    def http(method: str, path: str, body: Any = None) -> str:
        if isinstance(body, str) and body.strip():
            try:
                body = json.loads(body)
            except json.JSONDecodeError as e:
                raise ApiToolError(f"body is not JSON ({e.msg})") from None
        elif isinstance(body, str):
            body = None
        return session.http(method, path, body)

    return [
        Tool(
            "http",
            "Call the API: method GET or POST, a path like /v1/users?name=Ada, and for POST a "
            "JSON body.",
            {
                "method": text_arg("GET or POST"),
                "path": text_arg("path with query string"),
                "body": {"type": "object", "description": "JSON body for POST (optional)"},
            },
            http,
            optional=("body",),
        )
    ]


def agent(task: Task, llm: LLM, session: ApiSession) -> None:
    messages: list[dict[str, Any]] = [
        {"role": "system", "content": SYSTEM},
        {"role": "user", "content": task.prompt},
    ]
    run_tool_loop(
        llm.client(), llm.model, messages, tools_for(session), (ApiToolError,),
        done=lambda: session.answered, max_steps=MAX_STEPS, max_tokens=MAX_TOKENS,
        temperature=TEMPERATURE,
    )  # fmt: skip
