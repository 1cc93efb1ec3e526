"""Weights published to an engine's own copy (engines/replica.py): the deadline, the retry, the
loud error, and the KV blocks a continuous-batching cache must forget after a publish."""

from __future__ import annotations

import asyncio
import copy
import logging
import time
from typing import Any

import pytest
import torch

from jetctl.recipe import GenerationConfig
from jetctl.server.engines import GenRequest
from jetctl.server.engines.continuous import ContinuousEngine
from jetctl.server.engines.replica import PublishError, Replica
from tests.server.test_engines import LOGPROB_TOL, check_reply, prompts, serve

pytestmark = [pytest.mark.unit, pytest.mark.timeout(120)]

# bfloat16 keeps 8 bits of mantissa: on builtin:tiny a reply batched and the same reply
# teacher-forced alone differed by up to 0.005 (float32: ~1e-6); another version by 0.4-1.6
BF16_TOL = 0.02


def _replica_engine(publish_timeout_s: float) -> tuple[Any, Replica]:
    """A started hf engine on a replica (a second device's path) and that replica."""
    s = serve("hf-replica", generation=GenerationConfig(
        device="cpu", publish_timeout_s=publish_timeout_s))
    s.engine.start()
    assert s.publish is not None
    return s, s.publish.__self__  # type: ignore[attr-defined]


def test_a_publish_copies_only_what_training_changes() -> None:
    s = serve("hf")
    for name, p in s.model.named_parameters():
        p.requires_grad_(name.endswith("lm_head.weight") or "layers.0.mlp" in name)
    replica = Replica(s.model, device="cpu", version=0, timeout_s=1.0)
    frozen_before = replica.model.model.layers[1].mlp.up_proj.weight.clone()
    s.step(seed=1)  # changes every tensor of the trainer's model
    replica.publish(1)
    trained = dict(s.model.named_parameters())
    for name, p in replica.model.named_parameters():
        if trained[name].requires_grad:
            assert torch.equal(p, trained[name]), name
    assert torch.equal(replica.model.model.layers[1].mlp.up_proj.weight, frozen_before)
    assert replica.version == 1 and replica.figures.published == 1


async def test_a_publish_that_misses_its_deadline_is_retried_then_fails_loudly(
    caplog: pytest.LogCaptureFixture,
) -> None:
    s, replica = _replica_engine(publish_timeout_s=0.2)
    replica.staged = False  # the waiting publish (continuous engines, full fine-tuning)
    caplog.set_level(logging.ERROR, "jetctl.server.engines")
    replica.gate.acquire()  # a generate batch that never lets go of the weights
    await asyncio.to_thread(s.step, seed=1)  # two attempts of 0.2 s, then the step goes on
    assert replica.version == 0 and replica.figures.missed_attempts == 2
    assert sum("missed its 0.2s deadline" in r.message for r in caplog.records) == 2
    replica.gate.release()

    req = GenRequest(prompts(1)[0], max_tokens=6, temperature=1.0, top_p=1.0)
    res = await s.engine.generate(req)
    assert res.model_version == 0  # the engine says which weights it used, and they were 0's
    check_reply(s, req, res)

    await asyncio.to_thread(s.step, seed=2)  # the next step catches up
    assert replica.version == 2 and replica.figures.misses_in_a_row == 0
    res = await s.engine.generate(req)
    assert res.model_version == 2
    check_reply(s, req, res)

    replica.gate.acquire()
    await asyncio.to_thread(s.step, seed=3)
    await asyncio.to_thread(s.step, seed=4)
    with pytest.raises(PublishError, match="no new weights for 3 steps in a row"):
        await asyncio.to_thread(s.step, seed=5)
    replica.gate.release()
    await s.engine.stop()


async def test_a_staged_publish_does_not_wait_and_the_engine_takes_it_before_serving(
    caplog: pytest.LogCaptureFixture,
) -> None:
    s, replica = _replica_engine(publish_timeout_s=0.2)
    assert replica.staged, "an adapter-sized hf replica stages its publishes"
    caplog.set_level(logging.ERROR, "jetctl.server.engines")
    replica.gate.acquire()  # a batch in flight: the trainer must not wait for it
    t0 = time.monotonic()
    await asyncio.to_thread(s.step, seed=1)
    assert time.monotonic() - t0 < 0.2 * 2  # a waiting publish would take two deadlines
    assert replica.version == 0 and replica.pending() and replica.figures.missed_attempts == 0
    replica.gate.release()

    req = GenRequest(prompts(1)[0], max_tokens=6, temperature=1.0, top_p=1.0)
    res = await s.engine.generate(req)
    assert res.model_version == 1  # the engine applied the staged weights before serving
    assert not replica.pending()
    check_reply(s, req, res)  # and every token came from version 1's weights

    await asyncio.to_thread(s.step, seed=2)  # an idle engine: copied at once
    assert replica.version == 2 and not replica.pending()

    replica.gate.acquire()  # an engine that never lets go: staged versions pile up, then fail
    await asyncio.to_thread(s.step, seed=3)
    await asyncio.sleep(0.25)
    await asyncio.to_thread(s.step, seed=4)
    await asyncio.to_thread(s.step, seed=5)
    with pytest.raises(PublishError, match="no new weights for 3 steps in a row"):
        await asyncio.to_thread(s.step, seed=6)
    assert any("has not taken a staged version" in r.message for r in caplog.records)
    replica.gate.release()
    res = await s.engine.generate(req)
    assert res.model_version == 6  # the newest staged version, whole
    check_reply(s, req, res)
    await s.engine.stop()


async def test_continuous_publish_waits_for_the_request_in_flight_or_misses() -> None:
    s = serve("continuous", generation=GenerationConfig(publish_timeout_s=0.05))
    s.engine.start()
    long = GenRequest(prompts(1)[0], max_tokens=150, temperature=1.0, top_p=1.0)
    running = asyncio.create_task(s.engine.generate(long))
    await asyncio.sleep(0.2)
    await asyncio.to_thread(s.step, seed=1)  # cannot drain the long request within 2 x 0.05 s
    res = await running
    assert res.model_version == 0
    check_reply(s, long, res)  # every token of it came from version 0's weights
    await s.engine.stop()


async def test_continuous_forgets_cached_prefix_blocks_after_a_publish() -> None:
    """Prefix sharing reuses the KV blocks of an earlier request with the same prompt; after a
    publish those blocks were computed by the old weights and must not be reused."""
    s = serve("hf")  # the trainer-side model; the engine below gets a replica of it
    replica = Replica(s.model, device="cpu", version=0, timeout_s=10.0)
    s.publish = replica.publish
    engine = ContinuousEngine(
        replica, eos_token_ids=[s.eos], pad_token_id=s.eos, max_batch_size=8,
        max_new_tokens=16, batch_wait_ms=0, page_size=8,  # 8-token pages: 5 full ones below
    )
    s.engine = engine
    engine.start()
    shared = (prompts(8)[-1] * 3)[:44]
    req = GenRequest(shared, max_tokens=8, temperature=1.0, top_p=1.0)
    check_reply(s, req, await engine.generate(req))
    check_reply(s, req, await engine.generate(req))  # served from cached blocks, same version
    await asyncio.to_thread(s.step, seed=3)
    after = await engine.generate(req)
    assert after.model_version == 1
    check_reply(s, req, after)  # stale blocks would be off by far more than LOGPROB_TOL
    assert LOGPROB_TOL < 1e-3
    await engine.stop()


@torch.no_grad()
def _cast_reference(
    s: Any, version: int, prompt: list[int], completion: list[int], dtype: torch.dtype
) -> list[float]:
    """Teacher-forced untempered logprobs of `completion` under `version`'s weights cast to
    `dtype` (parameters only, as the replica casts them)."""
    model = copy.deepcopy(s.model)
    model.load_state_dict(s.versions[version])
    for p in model.parameters():
        p.data = p.data.to(dtype)
    logits = model(input_ids=torch.tensor([prompt + completion])).logits.float()[0]
    lp = torch.log_softmax(logits[len(prompt) - 1 : -1], dim=-1)
    return lp.gather(-1, torch.tensor(completion).unsqueeze(-1)).squeeze(-1).tolist()


def _gap(a: list[float], b: list[float]) -> float:
    return max(abs(x - y) for x, y in zip(a, b))


async def test_generation_dtype_serves_a_bfloat16_copy_whose_replies_name_their_version() -> None:
    s = serve("hf", generation=GenerationConfig(dtype="bfloat16"))
    assert s.publish is not None, "another dtype than the model's needs a copy of its own"
    replica = s.publish.__self__  # type: ignore[attr-defined]
    assert {p.dtype for p in replica.model.parameters()} == {torch.bfloat16}
    assert {p.dtype for p in s.model.parameters()} == {torch.float32}  # the trainer's: as it was
    s.engine.start()
    try:
        replies = []
        for version in (0, 1):
            reqs = [GenRequest(p, max_tokens=10, temperature=1.0, top_p=1.0) for p in prompts(12)]
            results = await asyncio.gather(*(s.engine.generate(r) for r in reqs))
            assert {r.model_version for r in results} == {version}
            replies += list(zip(reqs, results))
            if version == 0:
                await asyncio.to_thread(s.step, seed=3)  # publishes version 1, cast
        assert replica.version == 1
        to_fp32 = []
        for req, res in replies:
            args = (req.prompt_ids, res.completion_ids)
            own = _cast_reference(s, res.model_version, *args, torch.bfloat16)
            other = _cast_reference(s, 1 - res.model_version, *args, torch.bfloat16)
            # explained by its own version's bfloat16 weights, batched or alone ...
            assert _gap(res.completion_logprobs, own) <= BF16_TOL
            # ... and not by the other version's (the check can fail)
            assert _gap(res.completion_logprobs, other) > 4 * BF16_TOL
            to_fp32.append(_gap(res.completion_logprobs, s.reference_logprobs(res.model_version, *args)))
        # generated in bfloat16, not float32: the float32 weights explain the replies less well
        assert max(to_fp32) > 10 * LOGPROB_TOL
    finally:
        await s.engine.stop()
