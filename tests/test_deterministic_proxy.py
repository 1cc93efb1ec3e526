"""The proxy's half of `run.deterministic: true`: a rollout opened with `RolloutSeeds` sends
each unseeded request with the seed of its call index, and an agent's own seed goes as it
was given; a rollout opened without them sends none.

The OpenAI SDK talks to the real proxy, whose real transport reaches a fake Swarm server on
loopback (tests/client/client_fakes.py), which records each GenerateRequest as it arrived.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import openai
import pytest

from jetctl.client.proxy import Proxy, Sampling, ServedModel
from jetctl.client.timeline import ChatRenderer
from jetctl.client.transport import ServerBackend, SwarmTransport
from jetctl.deterministic import RolloutSeeds
from jetctl.models import tokenizer_from_files
from tests.client.client_fakes import TOKEN, FakeSwarm, start_fake_server, tiny_tokenizer_files

pytestmark = [pytest.mark.integration, pytest.mark.timeout(60)]


@pytest.fixture
async def stack(tmp_path: Path) -> AsyncIterator[tuple[FakeSwarm, Proxy]]:
    files = tiny_tokenizer_files()
    fake = FakeSwarm(tokenizer_from_files(files), files, max_context_tokens=256)
    server, _ = await start_fake_server(fake, tmp_path)
    transport = SwarmTransport("policy", TOKEN, run_dir=tmp_path)
    reply = await transport.register("digits-0", "digits", "r0")
    renderer = ChatRenderer(
        tokenizer_from_files(dict(reply.tokenizer_files)), list(reply.eos_token_ids)
    )
    served = ServedModel("policy", renderer, ServerBackend(transport), reply.max_context_tokens)
    proxy = Proxy({"policy": served}, "policy", Sampling(max_tokens=4))
    await proxy.start()
    yield fake, proxy
    await proxy.stop()
    await transport.close()
    await server.stop(None)


def _three_calls(base_url: str) -> None:
    """Two calls without a seed, then one with seed=5."""
    client = openai.OpenAI(base_url=base_url, api_key="x", max_retries=0)
    messages: list[Any] = [{"role": "user", "content": "Reply with the digit 7."}]
    client.chat.completions.create(model="policy", messages=messages)
    client.chat.completions.create(model="policy", messages=messages)
    client.chat.completions.create(model="policy", messages=messages, seed=5)


async def test_a_seeded_rollouts_calls_carry_the_seed_of_their_index(
    stack: tuple[FakeSwarm, Proxy],
) -> None:
    fake, proxy = stack
    seeds = RolloutSeeds("det", "digits-0", group=2, trajectory=1)
    proxy.open("r1", seeds)
    await asyncio.to_thread(_three_calls, proxy.base_url("r1"))
    proxy.close("r1")
    sent = [r.seed if r.HasField("seed") else None for r in fake.generate_calls]
    assert sent == [seeds.for_call(0), seeds.for_call(1), 5]

    fake.generate_calls.clear()
    proxy.open("r2")  # the flag off: the requests go as the agent made them
    await asyncio.to_thread(_three_calls, proxy.base_url("r2"))
    proxy.close("r2")
    assert [r.seed if r.HasField("seed") else None for r in fake.generate_calls] == [None, None, 5]
