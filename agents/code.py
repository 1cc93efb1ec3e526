"""Tool-calling agent for envs/code: try code in the sandbox, then submit a solution.

Tools: those of the session's level among run_python(code) and submit(code) (the session's
methods; see envs/code). The conversation starts from `session.opening()` (at the easy level
after a prior exchange). The loop is `agents.tool_loop.run_tool_loop`; it ends at the
submission, when the model answers without a tool call, or after the level's
`session.max_steps` model calls. At the hard level, a loop that ended without a submission
submits the last fenced code block of the model's replies that defines the task's function
(small models often answer with the code instead of calling submit): the model wrote it,
the hidden tests grade it. The easy level asks for the call itself, so it has no such
fallback. Sampling is the endpoint's (on a client node, the recipe's `sampling`).
Run with `agent = "agents.code:agent"`. Left out: an async variant.
"""

from __future__ import annotations

import re

from agents.tool_loop import Tool, run_tool_loop, text_arg
from envs.code import CodeSession, CodeToolError
from jetctl.env import LLM, Task


def tools_for(session: CodeSession) -> list[Tool]:
    """The sandbox tools the session's level offers."""
    tools = [
        Tool("run_python", "Run a Python script in a sandbox; returns exit code, stdout, stderr.",
             {"code": text_arg("the script")}, session.run_python),
        Tool("submit", "Submit the complete solution (only the first submission counts).",
             {"code": text_arg("the solution's source code")}, session.submit),
    ]  # fmt: skip
    return [t for t in tools if t.name in session.tool_names]


_FENCE = re.compile(r"```[ \t]*(?:python|py)?[ \t]*\n(.*?)```", re.DOTALL | re.IGNORECASE)


def code_in_reply(text: str, function: str) -> str | None:
    """The last fenced code block of `text` that defines `function`, or None."""
    defines = re.compile(rf"\bdef\s+{re.escape(function)}\s*\(")
    blocks = [b for b in _FENCE.findall(text) if defines.search(b)]
    return blocks[-1] if blocks else None


def agent(task: Task, llm: LLM, session: CodeSession) -> None:
    messages = run_tool_loop(
        llm.client(), llm.model, session.opening(), tools_for(session), (CodeToolError,),
        done=lambda: session.done, max_steps=session.max_steps,
    )  # fmt: skip
    if session.done or session.level != "hard":
        return
    for message in reversed(messages):
        if message.get("role") == "assistant" and isinstance(message.get("content"), str):
            code = code_in_reply(message["content"], session.problem.function)
            if code is not None:
                session.submit(code)
                return
