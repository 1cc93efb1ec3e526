"""The OpenAI SDK (sync and async) talks to the proxy; each request is one recorded LLMCall."""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import openai
import pytest

from jetctl.client.proxy import Proxy, Sampling, ServedModel
from jetctl.client.timeline import ChatRenderer
from jetctl.client.transport import ServerBackend, SwarmTransport
from jetctl.models import tokenizer_from_files
from tests.client.client_fakes import TOKEN, FakeSwarm, start_fake_server

pytestmark = [pytest.mark.integration, pytest.mark.timeout(60)]

TOOLS = [{"type": "function", "function": {"name": "add", "parameters": {"type": "object"}}}]


@pytest.fixture
async def stack(
    tokenizer: Any, tokenizer_files: dict[str, bytes], tmp_path: Path
) -> AsyncIterator[tuple[FakeSwarm, Proxy]]:
    fake = FakeSwarm(tokenizer, tokenizer_files, max_context_tokens=256)
    server, _ = await start_fake_server(fake, tmp_path)
    transport = SwarmTransport("policy", TOKEN, run_dir=tmp_path)
    reply = await transport.register("node-0", "digits", "r0")
    renderer = ChatRenderer(
        tokenizer_from_files(dict(reply.tokenizer_files)), list(reply.eos_token_ids)
    )
    served = ServedModel("policy", renderer, ServerBackend(transport), reply.max_context_tokens)
    proxy = Proxy({"policy": served}, "policy", Sampling(temperature=0.7, top_p=0.9, max_tokens=16))
    await proxy.start()
    yield fake, proxy
    await proxy.stop()
    await transport.close()
    await server.stop(None)


async def test_sync_client_two_turns_reuse_ids(stack: tuple[FakeSwarm, Proxy]) -> None:
    fake, proxy = stack
    timeline = proxy.open("r1")

    def agent() -> tuple[Any, Any]:
        client = openai.OpenAI(base_url=proxy.base_url("r1"), api_key="x", max_retries=0)
        messages: list[Any] = [{"role": "user", "content": "Reply with the digit 7."}]
        first = client.chat.completions.create(model="policy", messages=messages)
        messages += [first.choices[0].message, {"role": "user", "content": "Again."}]
        second = client.chat.completions.create(model="policy", messages=messages, max_tokens=3)
        return first, second

    first, second = await asyncio.to_thread(agent)
    assert first.choices[0].message.content == "7777" and first.choices[0].finish_reason == "stop"
    assert second.choices[0].finish_reason == "length"  # max_tokens=3 < 4 digits + end of turn
    calls = proxy.close("r1").calls
    assert len(calls) == 2 and timeline.turns[1].reused
    assert calls[1].prompt_ids[: len(calls[0].prompt_ids) + len(calls[0].completion_ids)] == (
        calls[0].prompt_ids + calls[0].completion_ids
    )
    assert first.usage.prompt_tokens == len(calls[0].prompt_ids)
    assert first.usage.completion_tokens == len(calls[0].completion_ids) == 5
    assert calls[0].completion_logprobs == [-0.5] * 5 and calls[0].model_version == 0
    req = fake.generate_calls[0]
    assert (
        req.max_tokens == 16
        and req.temperature == pytest.approx(0.7)
        and req.top_p == pytest.approx(0.9)
    )
    assert list(req.stop_token_ids) == [proxy.models["policy"].renderer.eos_token_ids[0]]


async def test_async_client_tool_calls(stack: tuple[FakeSwarm, Proxy]) -> None:
    fake, proxy = stack
    fake.reply_text = lambda _p: (
        '<tool_call>\n{"name": "add", "arguments": {"a": 1, "b": 2}}\n</tool_call>'
    )
    proxy.open("r2")
    client = openai.AsyncOpenAI(base_url=proxy.base_url("r2"), api_key="x", max_retries=0)
    messages: list[Any] = [{"role": "user", "content": "1+2?"}]
    reply = await client.chat.completions.create(
        model="policy", messages=messages, tools=TOOLS, max_tokens=64
    )  # type: ignore[arg-type]
    choice = reply.choices[0]
    assert choice.finish_reason == "tool_calls" and choice.message.content is None
    call = choice.message.tool_calls[0]
    assert call.function.name == "add" and json.loads(call.function.arguments) == {"a": 1, "b": 2}
    fake.reply_text = lambda _p: "3"
    messages += [choice.message, {"role": "tool", "tool_call_id": call.id, "content": "3"}]
    final = await client.chat.completions.create(
        model="policy", messages=messages, tools=TOOLS, max_tokens=64
    )  # type: ignore[arg-type]
    assert final.choices[0].message.content == "3"
    calls = proxy.close("r2").calls
    head = calls[0].prompt_ids + calls[0].completion_ids
    assert calls[1].prompt_ids[: len(head)] == head and calls[0].finish_reason == "tool_calls"
    await client.close()


async def test_errors_are_openai_errors(stack: tuple[FakeSwarm, Proxy]) -> None:
    fake, proxy = stack
    client = openai.AsyncOpenAI(base_url=proxy.base_url("nope"), api_key="x", max_retries=0)
    with pytest.raises(openai.NotFoundError):
        await client.chat.completions.create(
            model="policy", messages=[{"role": "user", "content": "hi"}]
        )
    proxy.open("r3")
    client = openai.AsyncOpenAI(base_url=proxy.base_url("r3"), api_key="x", max_retries=0)
    with pytest.raises(openai.BadRequestError, match="context limit"):
        await client.chat.completions.create(
            model="policy", messages=[{"role": "user", "content": "7 " * 400}]
        )
    with pytest.raises(openai.BadRequestError, match="stream"):
        await client.chat.completions.create(
            model="policy", messages=[{"role": "user", "content": "hi"}], stream=True
        )
    models = await client.models.list()
    assert [m.id for m in models.data] == ["policy"]
    # a model this node does not serve is an error naming the ones it does, not a silent
    # switch to the task's model (whose server would then train on the call)
    with pytest.raises(openai.BadRequestError, match="'gpt-4o' is not served.*known models: policy"):
        await client.chat.completions.create(
            model="gpt-4o", messages=[{"role": "user", "content": "hi"}]
        )
    # the context limit clamps max_tokens
    await client.chat.completions.create(
        model="policy", messages=[{"role": "user", "content": "7 " * 100}], max_tokens=500
    )
    assert fake.generate_calls[-1].max_tokens == 256 - len(fake.generate_calls[-1].prompt_ids)
    assert proxy.close("r3").calls[0].finish_reason == "stop"
    await client.close()


async def test_a_closed_rollout_cancels_its_generation_at_the_server(
    stack: tuple[FakeSwarm, Proxy],
) -> None:
    """A rollout that times out while its request waits for the model: closing it cancels
    the Generate call, so the server does not generate for a rollout that is gone."""
    fake, proxy = stack
    fake.generate_delay_s = 30.0
    proxy.open("r4")
    client = openai.AsyncOpenAI(base_url=proxy.base_url("r4"), api_key="x", max_retries=0)
    request = asyncio.create_task(client.chat.completions.create(
        model="policy", messages=[{"role": "user", "content": "hi"}]
    ))
    while not fake.generate_calls:
        await asyncio.sleep(0.02)
    t0 = time.monotonic()
    assert proxy.close("r4").calls == []
    with pytest.raises(openai.ConflictError, match="ended while its request was generating"):
        await request
    assert time.monotonic() - t0 < 10, "the waiting request is answered at once"
    deadline = time.monotonic() + 10
    while not fake.generate_cancelled and time.monotonic() < deadline:
        await asyncio.sleep(0.05)
    assert fake.generate_cancelled == 1
    await client.close()


async def test_the_openai_seed_reaches_the_server_and_only_when_given(
    stack: tuple[FakeSwarm, Proxy],
) -> None:
    """`seed` goes to the server on the wire (which honours it per request); a request
    without one leaves the field absent (0 is a seed like any other); a seed that is not a
    whole int64 is a 400."""
    fake, proxy = stack
    proxy.open("r5")
    client = openai.AsyncOpenAI(base_url=proxy.base_url("r5"), api_key="x", max_retries=0)
    hi = [{"role": "user", "content": "hi"}]
    for seed in (0, 41):
        await client.chat.completions.create(model="policy", messages=hi, seed=seed)  # type: ignore[arg-type]
        req = fake.generate_calls[-1]
        assert req.HasField("seed") and req.seed == seed
    await client.chat.completions.create(model="policy", messages=hi)  # type: ignore[arg-type]
    assert not fake.generate_calls[-1].HasField("seed")
    for bad in (True, 2**63, 1.5):
        with pytest.raises(openai.BadRequestError, match="seed must be a whole number"):
            await client.chat.completions.create(
                model="policy", messages=hi, extra_body={"seed": bad})  # type: ignore[arg-type]
    await client.close()
