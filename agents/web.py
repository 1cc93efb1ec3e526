"""Tool-calling agent for envs/web: browse the shop with browser tools until the model stops.

Tools: those of the session's level among open, click, fill, submit, read, links (the
session's methods; see envs/web). The conversation starts from `session.opening()` (at the
easy level: a prior exchange, then the task with the page the browser shows). The loop is
`agents.tool_loop.run_tool_loop`; the episode ends when the model answers without a tool
call or after the level's `session.max_steps` model calls. Sampling (max_tokens,
temperature) is the endpoint's: on a client node, the recipe's `sampling`.
Run with `agent = "agents.web:agent"`.
Left out: screenshots, an async variant.
"""

from __future__ import annotations

from agents.tool_loop import Tool, run_tool_loop, text_arg
from envs.web import WebSession, WebToolError
from jetctl.env import LLM, Task


def tools_for(session: WebSession) -> list[Tool]:
    """The browser tools the session's level offers."""
    tools = [
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
    return [t for t in tools if t.name in session.tool_names]


def agent(task: Task, llm: LLM, session: WebSession) -> None:
    run_tool_loop(
        llm.client(), llm.model, session.opening(), tools_for(session), (WebToolError,),
        done=lambda: False, max_steps=session.max_steps,
    )  # fmt: skip
