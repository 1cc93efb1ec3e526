"""Tool-calling agent for envs/code: try code in the sandbox, then submit a solution.

Tools: run_python(code) and submit(code) (the session's methods; see envs/code). The loop is
`agents.tool_loop.run_tool_loop`; it ends at the submission, when the model answers without
a tool call, or after MAX_STEPS model calls. Run with `agent = "agents.code:agent"`.
Left out: extracting code from a plain (non-tool) reply; an async variant.
"""

from __future__ import annotations

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


def agent(task: Task, llm: LLM, session: CodeSession) -> None:
    messages: list[dict[str, Any]] = [
        {"role": "system", "content": SYSTEM},
        {"role": "user", "content": task.prompt},
    ]
    run_tool_loop(
        llm.client(), llm.model, messages, tools_for(session), (CodeToolError,),
        done=lambda: session.done, max_steps=MAX_STEPS, max_tokens=MAX_TOKENS,
        temperature=TEMPERATURE,
    )  # fmt: skip
