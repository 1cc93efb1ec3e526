"""A scripted model behind the real OpenAI-compatible proxy, for the tool-loop agent tests.

`ScriptedEndpoint(script, chat_template=None)` serves `jetctl.client.proxy.Proxy` on loopback (its event loop in
a thread) with builtin:tiny's tokenizer and chat template and a backend that, instead of a
model, answers each prompt with `script(prompt_text)` tokenized (then end of turn). So a
scripted `<tool_call>{...}</tool_call>` goes through the same parsing as a real model's,
and the agent sees OpenAI tool_calls. `chat_template` replaces the tokenizer's, to serve a
model whose template declares another tool-call format. `prompts` holds every rendered prompt and `timeline`
the recorded calls.
"""

from __future__ import annotations

import asyncio
import json
import threading
from collections.abc import Callable
from typing import Any

from jetctl.client.backend import GenerateParams, GenerateResult
from jetctl.client.proxy import Proxy, Sampling, ServedModel
from jetctl.client.timeline import ChatRenderer, Timeline
from jetctl.env import LLM

ROLLOUT = "r-scripted"


def tool_call(name: str, **arguments: Any) -> str:
    """The completion text of one tool call, in the format the proxy parses."""
    return f"<tool_call>\n{json.dumps({'name': name, 'arguments': arguments})}\n</tool_call>"


def replies(*texts: str) -> Callable[[str], str]:
    """A script answering the n-th prompt with texts[n] (then "done." forever)."""
    queue = list(texts)
    return lambda _prompt: queue.pop(0) if queue else "done."


class _ScriptedBackend:
    def __init__(self, tokenizer: Any, eos: int, script: Callable[[str], str]) -> None:
        self.tokenizer, self.eos, self.script = tokenizer, eos, script
        self.prompts: list[str] = []

    async def generate(self, params: GenerateParams) -> GenerateResult:
        prompt = self.tokenizer.decode(params.prompt_ids, skip_special_tokens=False)
        self.prompts.append(prompt)
        ids = list(self.tokenizer.encode(self.script(prompt), add_special_tokens=False))
        ids.append(self.eos)
        finish = "stop"
        if len(ids) > params.max_tokens:
            ids, finish = ids[: params.max_tokens], "length"
        return GenerateResult(ids, [-0.5] * len(ids), 0, finish)


class ScriptedEndpoint:
    """Start with `with ScriptedEndpoint(script) as endpoint:`; `endpoint.llm` for the agent."""

    def __init__(
        self,
        script: Callable[[str], str],
        chat_template: str | None = None,
        roles: tuple[str, ...] = (),
    ) -> None:
        """`roles`: serve a team's roles by name (each a role of model "policy") instead of
        the model "policy"."""
        from jetctl.models import build_tiny_tokenizer

        tokenizer = build_tiny_tokenizer()
        if chat_template is not None:
            tokenizer.chat_template = chat_template
        eos = tokenizer.convert_tokens_to_ids("<|im_end|>")
        assert isinstance(eos, int)
        self.backend = _ScriptedBackend(tokenizer, eos, script)
        renderer = ChatRenderer(tokenizer, [eos])
        served = {
            name: ServedModel(name, renderer, self.backend, 1_000_000, "policy", name)
            for name in roles
        } or {"policy": ServedModel("policy", renderer, self.backend, 1_000_000)}
        # agents leave max_tokens to the endpoint: a script is never cut short
        self.proxy = Proxy(served, None if roles else "policy", Sampling(max_tokens=100_000))
        self.loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self.loop.run_forever, daemon=True)
        self.timeline: Timeline | None = None

    @property
    def prompts(self) -> list[str]:
        return self.backend.prompts

    @property
    def llm(self) -> LLM:
        return LLM(base_url=self.proxy.base_url(ROLLOUT), model="policy")

    def __enter__(self) -> ScriptedEndpoint:  # noqa: PYI034  # typing.Self needs 3.11
        self._thread.start()
        asyncio.run_coroutine_threadsafe(self.proxy.start(), self.loop).result(30)
        self.timeline = self.proxy.open(ROLLOUT)
        return self

    def __exit__(self, *exc: object) -> None:
        asyncio.run_coroutine_threadsafe(self.proxy.stop(), self.loop).result(30)
        self.loop.call_soon_threadsafe(self.loop.stop)
        self._thread.join(10)
        self.loop.close()
