"""`generation.workers`: several hf engines behind one, on the tiny model (real forwards).

What a user relies on: a group's requests are decoded together on one worker (its prompt is
prefilled once), a conversation's next turn goes where its earlier turn's KV is, the other
worker takes the next group instead of queueing behind the first, a published version
reaches every worker, and the workers' replies are the same policy as one engine's.
"""

from __future__ import annotations

import asyncio
import threading
from typing import Any

import pytest
import torch

from jetctl.recipe import GenerationConfig, ModelConfig
from jetctl.server.engines import GenRequest, ServingEngine, make_engine
from jetctl.server.engines.workers import IMBALANCE_ROWS, EngineWorkers
from jetctl.server.locks import WeightsLock


def cfg(workers: int) -> ModelConfig:
    return ModelConfig(model="builtin:tiny", finetune="lora",
                       generation=GenerationConfig(threads=workers, workers=workers))


@pytest.fixture(scope="module")
def model() -> Any:
    from jetctl.server.step import load_trainable

    model, _ = load_trainable(cfg(2), attn_implementation="sdpa")
    return model


def serve(model: Any, workers: int) -> ServingEngine:
    return make_engine(cfg(workers), model, eos_token_ids=[2], pad_token_id=2,
                       weights_lock=WeightsLock(), version=lambda: 0)


def greedy(prompt: list[int], n: int = 6) -> GenRequest:
    return GenRequest(prompt, n, 0.0, 1.0)


def test_a_group_stays_on_one_worker_and_the_next_group_goes_to_the_other(model: Any) -> None:
    threads: dict[str, int] = {}
    handle = model.register_forward_hook(  # each replica is a deep copy: the hook goes along
        lambda *_: threads.__setitem__(threading.current_thread().name,
                                        threads.get(threading.current_thread().name, 0) + 1))
    serving = serve(model, 2)
    handle.remove()  # the trainer's model itself generates nothing here
    engine = serving.engine
    assert isinstance(engine, EngineWorkers)

    async def run() -> list[int]:
        engine.start()
        try:
            group_a = [engine.generate(GenRequest([5, 6, 7, 8], 8, 1.0, 1.0)) for _ in range(4)]
            first = [asyncio.ensure_future(c) for c in group_a]
            await asyncio.sleep(0)  # group A is queued on its worker before group B arrives
            group_b = [engine.generate(GenRequest([9, 9, 4], 8, 1.0, 1.0)) for _ in range(4)]
            second = [asyncio.ensure_future(c) for c in group_b]
            await asyncio.gather(*first, *second)
            return list(engine.routed)
        finally:
            await engine.stop()

    routed = asyncio.run(run())
    assert routed == [4, 4]  # each group whole on one worker
    assert set(threads) == {"engine-0", "engine-1"}  # both decoded
    figures = engine.take_figures()
    assert figures["generate/workers"] == 2.0
    assert figures["generate/requests"] == 8.0
    # 6 of the 8 followed the first of their group (the two firsts had no owner)
    assert figures["generate/routed_followed"] == 6.0


def test_a_next_turn_follows_its_conversation_unless_that_worker_is_far_busier(
    model: Any,
) -> None:
    engine = serve(model, 2).engine
    assert isinstance(engine, EngineWorkers)
    turn_1 = list(range(10, 40))
    owner = engine.route(turn_1)
    engine.route([7] * 12)  # another conversation, elsewhere or not: it must not matter
    turn_2 = turn_1 + [50, 51, 52, 53]  # the reply and the env's answer appended
    assert engine.route(turn_2) == owner
    assert engine.route(turn_1 + [60]) == owner
    # a worker IMBALANCE_ROWS busier than the other loses even its own conversation
    busy = engine.engines[owner]
    busy._incoming.extend([object()] * IMBALANCE_ROWS)  # type: ignore[list-item]
    try:
        assert engine.route(turn_2 + [70]) == 1 - owner
    finally:
        busy._incoming.clear()


def test_the_workers_reply_as_one_engine_does_and_take_each_published_version(
    model: Any,
) -> None:
    prompts = [[5, 6, 7, 8], [9, 9, 4], [3, 1, 4, 1, 5], [2, 7, 1, 8]]

    async def replies(workers: int, publish_to: int | None) -> list[Any]:
        serving = serve(model, workers)
        serving.engine.start()
        try:
            if publish_to is not None:
                assert serving.publish is not None
                with torch.no_grad():  # the trainer's step: the adapter changes
                    for name, p in model.named_parameters():
                        if p.requires_grad and "lora_B" in name:
                            p.add_(0.05)
                serving.publish(publish_to)
            return list(await asyncio.gather(
                *(serving.engine.generate(greedy(p)) for p in prompts)))
        finally:
            await serving.engine.stop()

    one = asyncio.run(replies(1, None))
    two = asyncio.run(replies(2, None))
    assert [r.completion_ids for r in two] == [r.completion_ids for r in one]
    for a, b in zip(one, two):
        assert b.completion_logprobs == pytest.approx(a.completion_logprobs, abs=1e-4)
    after = asyncio.run(replies(2, 1))
    assert {r.model_version for r in after} == {1}
    # the published adapter is what both workers generate with now
    assert [r.completion_logprobs for r in after] != [r.completion_logprobs for r in two]
    with torch.no_grad():
        for name, p in model.named_parameters():
            if p.requires_grad and "lora_B" in name:
                p.sub_(0.05)
