"""Imported once by the node's rollout forkserver, so that each forked rollout starts warm.

Measured on one rollout of the arithmetic agent (CPU of the rollout process, 2-core box):
about 800 ms before, about 25 ms after. The costs, all paid again in every rollout because
what a child loads dies with it:

* multiprocessing re-runs the parent's `__main__` in every child it starts (for the node
  that is the `jetctl` entry script and what it imports; for a test, the test module).
  The forkserver is meant to run it once when `"__main__"` is preloaded, but Python 3.11's
  forkserver never gets the path (it asks the preparation data for `main_path`, which
  says `init_main_from_path`), so every child re-ran it: 0.2-1.8 s of CPU. The node names
  its main in `JETCTL_ROLLOUT_MAIN` (`rollout.main_spec`) and this module imports it here,
  the way multiprocessing would have, so each child finds it in place and skips it.
* the `openai` SDK and its HTTP client import most of themselves lazily, on the first
  request and the first parsed response (~200 ms of CPU; the HTTP core pulls in trio when
  it is installed). One real round trip here, sync and async, against a one-shot server on
  loopback, loads them into the memory every rollout inherits by fork.
* (in `jetctl.env.LLM`) every client loaded the CA bundle for TLS (~60 ms) although the
  node's endpoint is plain HTTP on loopback.

Import it only in a forkserver: it runs `asyncio.run` and serves two requests on loopback.
"""

from __future__ import annotations

import os
from typing import Any


def _adopt_main() -> None:
    from multiprocessing import process, spawn

    from jetctl.client.rollout import MAIN_ENV

    kind, _, where = os.environ.get(MAIN_ENV, "").partition(":")
    if not where:
        return
    process.current_process()._inheriting = True  # type: ignore[attr-defined]
    try:
        if kind == "path":
            spawn.import_main_path(where)
        elif kind == "name":
            spawn._fixup_main_from_name(where)  # type: ignore[attr-defined]
    finally:
        del process.current_process()._inheriting  # type: ignore[attr-defined]


_REPLY = {
    "id": "warm", "object": "chat.completion", "created": 0, "model": "warm",
    "choices": [{"index": 0, "finish_reason": "tool_calls", "message": {
        "role": "assistant", "content": "warm", "tool_calls": [{
            "id": "c", "type": "function", "function": {"name": "f", "arguments": "{}"}}]}}],
    "usage": {"prompt_tokens": 1, "completion_tokens": 1, "total_tokens": 2},
}
_MESSAGES = [
    {"role": "system", "content": "s"}, {"role": "user", "content": "u"},
    {"role": "assistant", "content": "a", "tool_calls": [
        {"id": "c", "type": "function", "function": {"name": "f", "arguments": "{}"}}]},
    {"role": "tool", "tool_call_id": "c", "content": "t"},
]
_TOOLS = [{"type": "function", "function": {
    "name": "f", "description": "d", "parameters": {"type": "object", "properties": {}}}}]


def _serve_two(server: Any) -> None:
    server.handle_request()
    server.handle_request()


def _warm_openai() -> None:
    """Whole chat.completions round trips, sync and async, the way a rollout makes them
    (`jetctl.env.LLM`'s clients) against a one-shot server on loopback: request building
    (the SDK's TypedDict transforms cache their type hints per process), the HTTP client
    and its core (imported on the first request: ~160 ms of CPU) and response parsing. The server
    thread ends before this returns, so the forkserver forks no threads."""
    import asyncio
    import http.server
    import json
    import threading

    from jetctl.env import LLM

    body = json.dumps(_REPLY).encode()

    class Handler(http.server.BaseHTTPRequestHandler):
        def do_POST(self) -> None:
            self.rfile.read(int(self.headers.get("Content-Length") or 0))
            self.send_response(200)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, *args: object) -> None:
            pass

    server = http.server.HTTPServer(("127.0.0.1", 0), Handler)
    server.timeout = 10.0  # handle_request gives up: a failed warm-up must not hang the node
    thread = threading.Thread(target=_serve_two, args=(server,))
    thread.start()
    llm = LLM(f"http://127.0.0.1:{server.server_port}/v1", "warm")
    kwargs = {"model": "warm", "messages": _MESSAGES, "tools": _TOOLS, "max_tokens": 1,
              "temperature": 1.0, "top_p": 1.0, "stop": ["x"], "seed": 0}
    try:
        with llm.client() as client:
            reply = client.chat.completions.create(**kwargs)
            reply.choices[0].message.model_dump(exclude_none=True)

        async def warm_async() -> None:
            async with llm.async_client() as client:
                await client.chat.completions.create(**kwargs)

        asyncio.run(warm_async())
    finally:
        thread.join(timeout=10)
        server.server_close()


def _soft_preload() -> None:
    """The modules the node named as worth loading once but not required to load
    (`RolloutRunner(soft_preload=...)`, a dataset task's reward module): one that fails here,
    whatever it raises, is imported again, and fails, in the rollout that needs it."""
    import importlib

    from jetctl.client.rollout import SOFT_PRELOAD_ENV

    for name in filter(None, os.environ.get(SOFT_PRELOAD_ENV, "").split(",")):
        try:
            importlib.import_module(name)
        except BaseException:  # noqa: BLE001, S110  # the rollout reports it, as before
            pass


_adopt_main()
_soft_preload()
_warm_openai()
