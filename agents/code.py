"""Tool-calling agent for envs/code: try code in the sandbox, then submit a solution.

Tools: run_python(code) and submit(code) (the session's methods; see envs/code). The loop is
`agents.tool_loop.run_tool_loop`; it ends at the submission, when the model answers without
a tool call, or after MAX_STEPS model calls. A loop that ended without a submission submits
the last fenced code block of the model's replies that defines the task's function (small
models often answer with the code instead of calling submit): the model wrote it, the hidden
tests grade it. Run with `agent = "agents.code:agent"`. Left out: an async variant.
"""

from __future__ import annotations

import re
from typing import Any

from agents.tool_loop import Tool, run_tool_loop, text_arg
from envs.code import CodeSession, CodeToolError
from jetctl.env import LLM, Task

MAX_STEPS = 6
MAX_TOKENS = 512
TEMPERATURE = 1.0
SYSTEM = (
    "You write Python. Test ideas with run_python, which runs a script and shows its output. "
    "Call submit once with the complete solution; hidden tests grade it."
)


def tools_for(session: CodeSession) -> list[Tool]:
    return [
        Tool("run_python", "Run a Python script in a sandbox; returns exit code, stdout, stderr.",
             {"code": text_arg("the script")}, session.run_python),
        Tool("submit", "Submit the complete solution (only the first submission counts).",
             {"code": text_arg("the solution's source code")}, session.submit),
    ]  # fmt: skip


_FENCE = re.compile(r"```[ \t]*(?:python|py)?[ \t]*\n(.*?)```", re.DOTALL | re.IGNORECASE)


def code_in_reply(text: str, function: str) -> str | None:
    """The last fenced code block of `text` that defines `function`, or None."""
    defines = re.compile(rf"\bdef\s+{re.escape(function)}\s*\(")
    blocks = [b for b in _FENCE.findall(text) if defines.search(b)]
    return blocks[-1] if blocks else None


def agent(task: Task, llm: LLM, session: CodeSession) -> None:
    messages: list[dict[str, Any]] = [
        {"role": "system", "content": SYSTEM},
        {"role": "user", "content": task.prompt},
    ]
    messages = run_tool_loop(
        llm.client(), llm.model, messages, tools_for(session), (CodeToolError,),
        done=lambda: session.done, max_steps=MAX_STEPS, max_tokens=MAX_TOKENS,
        temperature=TEMPERATURE,
    )  # fmt: skip
    if session.done:
        return
    for message in reversed(messages):
        if message.get("role") == "assistant" and isinstance(message.get("content"), str):
            code = code_in_reply(message["content"], session.problem.function)
            if code is not None:
                session.submit(code)
                return
