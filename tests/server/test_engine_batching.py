"""The HF engine's dynamic batching on builtin:tiny: how requests become batches.

`on_batch` reports each `generate` the engine runs (its size); the tests drive requests
and read those sizes: the cap (`max_batch_size`), the wait for company (`batch_wait_ms`),
one sampling setting per batch, and cancelled requests never generated.
(tests/server/test_engines.py checks what each reply holds; this file, how they are grouped.)
"""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Callable
from functools import cache
from typing import Any

import pytest

from jetctl.recipe import GenerationConfig, ModelConfig
from jetctl.server.engines import Engine, GenRequest, make_engine

pytestmark = [pytest.mark.unit, pytest.mark.timeout(120)]


@cache
def tiny() -> tuple[Any, int]:
    from jetctl.models import load_model

    model, tokenizer = load_model("builtin:tiny", progress=False)
    return model, int(tokenizer.eos_token_id)


def engine(sizes: list[int], lock: threading.Lock | None = None, **generation: Any) -> Engine:
    model, eos = tiny()
    cfg = ModelConfig(model="builtin:tiny", generation=GenerationConfig(**generation))
    return make_engine(
        cfg, model, eos_token_ids=[eos], pad_token_id=eos, weights_lock=lock or threading.Lock(),
        version=lambda: 0, on_batch=lambda n, _tokens, _s: sizes.append(n),
    ).engine


def request(i: int, temperature: float = 1.0) -> GenRequest:
    return GenRequest([5 + i, 6, 7, 8], max_tokens=2, temperature=temperature, top_p=1.0)


async def serve(sizes: list[int], body: Callable[[Engine], Any], **generation: Any) -> None:
    e = engine(sizes, **generation)
    e.start()
    try:
        await body(e)
    finally:
        await e.stop()


async def test_a_batch_holds_at_most_max_batch_size() -> None:
    sizes: list[int] = []

    async def body(e: Engine) -> None:
        await asyncio.gather(*(e.generate(request(i)) for i in range(8)))

    await serve(sizes, body, max_batch_size=3, batch_wait_ms=50)
    assert sum(sizes) == 8 and max(sizes) == 3 and sizes[0] == 3


async def test_one_sampling_setting_per_batch() -> None:
    sizes: list[int] = []

    async def body(e: Engine) -> None:
        await asyncio.gather(*(e.generate(request(i, temperature=float(i % 2))) for i in range(4)))

    await serve(sizes, body, max_batch_size=16, batch_wait_ms=50)
    assert sorted(sizes) == [2, 2]


def batch_sizes_of_staggered_requests(batch_wait_ms: float) -> list[int]:
    """Four requests 0.3 s apart: a long enough wait gathers them into one batch."""
    sizes: list[int] = []

    async def body(e: Engine) -> None:
        calls = []
        for i in range(4):
            calls.append(asyncio.ensure_future(e.generate(request(i))))
            await asyncio.sleep(0.3)
        await asyncio.gather(*calls)

    asyncio.run(serve(sizes, body, max_batch_size=16, batch_wait_ms=batch_wait_ms))
    return sizes


def test_batch_wait_ms_gathers_requests_that_arrive_apart() -> None:
    # no wait: the first request runs alone (the others come later, while it runs)
    assert batch_sizes_of_staggered_requests(batch_wait_ms=0.0)[0] == 1
    assert batch_sizes_of_staggered_requests(batch_wait_ms=2000.0) == [4]


async def test_cancelled_requests_are_never_generated() -> None:
    """Requests cancelled while they wait (their rollout ended) drop out of the next batch."""
    sizes: list[int] = []
    lock = threading.Lock()
    e = engine(sizes, lock=lock, max_batch_size=16, batch_wait_ms=0)
    e.start()
    try:
        lock.acquire()  # an optimizer step: the first batch waits for the weights
        first = asyncio.ensure_future(e.generate(request(0)))
        while e.busy_since is None:
            await asyncio.sleep(0.01)
        queued = [asyncio.ensure_future(e.generate(request(i))) for i in range(1, 5)]
        await asyncio.sleep(0.05)
        queued[1].cancel()
        queued[2].cancel()
        lock.release()
        await asyncio.gather(first, queued[0], queued[3])
        assert sizes == [1, 2]
    finally:
        if lock.locked():
            lock.release()
        await e.stop()
