"""Tool-calling agent for envs/web: browse the shop with browser tools until the model stops.

Tools: open, click, fill, submit, read, links (the session's methods; see envs/web). The loop
is `agents.tool_loop.run_tool_loop`; the episode ends when the model answers without a tool
call or after MAX_STEPS model calls. Run with `agent = "agents.web:agent"`.
Left out: screenshots, an async variant.
"""

from __future__ import annotations

from typing import Any

from agents.tool_loop import Tool, run_tool_loop, text_arg
from envs.web import WebSession, WebToolError
from jetctl.env import LLM, Task

MAX_STEPS = 20
MAX_TOKENS = 256
TEMPERATURE = 1.0
SYSTEM = (
    "You operate a web browser on a shop website whose home page is {url}. Use the tools to "
    "look around and act; read() shows the current page's text and links() its links. "
    "When the task is done, reply briefly without calling a tool."
)


def tools_for(session: WebSession) -> list[Tool]:
    return [
        Tool("open", "Open a page of the site by path (e.g. /cart) or full URL.",
             {"url": text_arg("path or URL on the site")}, session.open),
        Tool("click", "Click a link or button, by CSS selector or by its text.",
             {"target": text_arg("CSS selector, or the link's/button's text")}, session.click),
        Tool("fill", "Type text into a form field (CSS selector such as #q or #qty).",
             {"selector": text_arg("CSS selector of the field"), "text": text_arg("text to type")},
             session.fill),
        Tool("submit", "Submit the form of the given field, or of the last filled field.",
             {"selector": text_arg("CSS selector inside the form (optional)")}, session.submit,
             optional=("selector",)),
        Tool("read", "The visible text of the current page.", {}, session.read),
        Tool("links", "The links of the current page as `text -> path`.", {}, session.links),
    ]  # fmt: skip


def agent(task: Task, llm: LLM, session: WebSession) -> None:
    messages: list[dict[str, Any]] = [
        {"role": "system", "content": SYSTEM.format(url=session.url)},
        {"role": "user", "content": task.prompt},
    ]
    run_tool_loop(
        llm.client(), llm.model, messages, tools_for(session), (WebToolError,),
        done=lambda: False, max_steps=MAX_STEPS, max_tokens=MAX_TOKENS, temperature=TEMPERATURE,
    )  # fmt: skip
