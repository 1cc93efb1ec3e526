"""The tool-calling loop shared by agents/web.py, agents/code.py and agents/api.py.

    chat.completions.create(tools=...) -> run each tool call on the session -> append the
    results as `tool` messages -> again, until the model stops calling tools, `done()`
    says so, or `max_steps` model calls were made.

Each assistant message is appended exactly as the endpoint returned it (so the client node
reuses its token ids as the next prompt's prefix). `max_tokens` and `temperature` left None
are not sent, so the endpoint's defaults apply (on a client node: the recipe's `sampling`). A tool call with unparseable or wrong
arguments, or one the env refuses (its ToolError), is answered with an error text and the
loop goes on: the model's mistakes are part of the rollout, not a crash. Any other
exception is a failed rollout.
Left out: parallel tool execution, streaming, retries of failed model calls.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True)
class Tool:
    """One function the model may call: its OpenAI schema and what runs it."""

    name: str
    description: str
    parameters: dict[str, dict[str, Any]]  # argument name -> its JSON schema
    run: Callable[..., str]
    optional: tuple[str, ...] = ()

    def schema(self) -> dict[str, Any]:
        return {
            "type": "function",
            "function": {
                "name": self.name,
                "description": self.description,
                "parameters": {
                    "type": "object",
                    "properties": self.parameters,
                    "required": [k for k in self.parameters if k not in self.optional],
                },
            },
        }


def text_arg(description: str) -> dict[str, Any]:
    return {"type": "string", "description": description}


def call_tool(
    tools: dict[str, Tool], name: str, arguments: str, errors: tuple[type[Exception], ...]
) -> str:
    """Run one tool call; argument and env errors come back as text for the model."""
    tool = tools.get(name)
    if tool is None:
        return f"error: no tool {name!r}; tools are {', '.join(sorted(tools))}"
    try:
        args = json.loads(arguments or "{}")
    except json.JSONDecodeError as e:
        return f"error: arguments are not JSON ({e.msg})"
    if not isinstance(args, dict):
        return "error: arguments must be a JSON object"
    unknown = sorted(set(args) - set(tool.parameters))
    missing = [k for k in tool.parameters if k not in args and k not in tool.optional]
    if unknown or missing:
        return (
            f"error: {tool.name} takes {', '.join(tool.parameters)}"
            + (f"; unknown: {', '.join(unknown)}" if unknown else "")
            + (f"; missing: {', '.join(missing)}" if missing else "")
        )
    for k, v in args.items():  # a model writes 3 for "3"; text arguments get text
        if tool.parameters[k].get("type") == "string" and isinstance(v, (int, float)):
            args[k] = str(v)
    try:
        return str(tool.run(**args))
    except errors as e:
        return f"error: {e}"


def run_tool_loop(
    client: Any,
    model: str,
    messages: list[dict[str, Any]],
    tools: list[Tool],
    errors: tuple[type[Exception], ...],
    done: Callable[[], bool],
    max_steps: int,
    max_tokens: int | None = None,
    temperature: float | None = None,
) -> list[dict[str, Any]]:
    """The loop (see the module docstring); returns the conversation."""
    by_name = {t.name: t for t in tools}
    schemas = [t.schema() for t in tools]
    sampling: dict[str, Any] = {}
    if max_tokens is not None:
        sampling["max_tokens"] = max_tokens
    if temperature is not None:
        sampling["temperature"] = temperature
    for _ in range(max_steps):
        response = client.chat.completions.create(
            model=model, messages=messages, tools=schemas, **sampling
        )
        message: dict[str, Any] = response.choices[0].message.model_dump(exclude_none=True)
        messages.append(message)
        calls = message.get("tool_calls") or []
        if not calls:
            break
        for call in calls:
            fn = call["function"]
            result = call_tool(by_name, fn["name"], fn.get("arguments") or "{}", errors)
            messages.append({"role": "tool", "tool_call_id": call["id"], "content": result})
        if done():
            break
    return messages
