"""Tool-calling agent for envs/api: call the REST API until the answer is submitted.

Tools: those of the session's level (the session's methods; credentials and rate-limit waits
are handled there, see envs/api): hard: http(method, path, body), `body` a JSON object or a
JSON string; easy: get(path). The conversation starts from
`session.opening()` (at the easy level after a prior exchange). The loop is
`agents.tool_loop.run_tool_loop`; it ends once the task is answered, when the model answers
without a tool call, or after the level's `session.max_steps` model calls. Sampling is the
endpoint's (on a client node, the recipe's `sampling`). Run with `agent = "agents.api:agent"`.
Left out: an async variant.
"""

from __future__ import annotations

import json
from typing import Any

from agents.tool_loop import Tool, run_tool_loop, text_arg
from envs.api import ApiSession, ApiToolError
from jetctl.env import LLM, Task


def tools_for(session: ApiSession) -> list[Tool]:
    """The API tools the session's level offers."""

    def http(method: str, path: str, body: Any = None) -> str:
        if isinstance(body, str) and body.strip():
            try:
                body = json.loads(body)
            except json.JSONDecodeError as e:
                raise ApiToolError(f"body is not JSON ({e.msg})") from None
        elif isinstance(body, str):
            body = None
        return session.http(method, path, body)

    tools = [
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
        ),
        Tool("get", "GET a path of the API.", {"path": text_arg("the path")}, session.get),
    ]  # fmt: skip
    return [t for t in tools if t.name in session.tool_names]


def agent(task: Task, llm: LLM, session: ApiSession) -> None:
    run_tool_loop(
        llm.client(), llm.model, session.opening(), tools_for(session), (ApiToolError,),
        done=lambda: session.answered, max_steps=session.max_steps,
    )  # fmt: skip
