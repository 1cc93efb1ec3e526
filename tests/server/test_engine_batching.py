"""The HF engine's continuous batching on builtin:tiny: how requests share decode steps.

`on_batch` reports the rows of each decode step; `take_figures` the requests admitted and
the prompt tokens computed. The tests drive requests and read those: the cap
(`max_batch_size`), the wait for company (`batch_wait_ms`), every sampling setting in one
batch, a newcomer joining the batch under way, a group's shared prompt computed once,
a conversation's next turn computing only what is new (and replying as if computed
whole), the KV cache emptied by a new version and bounded in bytes, cancelled requests
never generated, and a waiting optimizer step getting the weights under steady load.
(tests/server/test_engines.py checks what each reply holds.)
"""

from __future__ import annotations

import asyncio
import threading
import time
from collections.abc import Callable
from functools import cache
from typing import Any

import pytest
import torch

from jetctl.recipe import GenerationConfig, ModelConfig
from jetctl.server.engines import Engine, GenRequest, GenResult, make_engine
from jetctl.server.engines.hf import KV_CACHE_BYTES, HFEngine
from jetctl.server.locks import WeightsLock

pytestmark = [pytest.mark.unit, pytest.mark.timeout(120)]

# fp32: KV computed a token at a time in one batch vs in one prefill differs only in the
# order of float sums (~1e-6 on builtin:tiny); another version's weights move it ~1e-1
LOGPROB_TOL = 1e-4


@cache
def tiny(attn_implementation: str = "eager") -> tuple[Any, int]:
    from jetctl.models import load_model

    model, tokenizer = load_model(
        "builtin:tiny", attn_implementation=attn_implementation,  # type: ignore[arg-type]
        progress=False,
    )
    return model, int(tokenizer.eos_token_id)


def engine(
    sizes: list[int], lock: Any = None, version: Callable[[], int] = lambda: 0,
    **generation: Any,
) -> HFEngine:
    model, eos = tiny()
    # on the trainer's model, behind `lock` (full fine-tuning; LoRA gets a staged replica)
    cfg = ModelConfig(model="builtin:tiny", finetune="full",
                      generation=GenerationConfig(**generation))
    e = make_engine(
        cfg, model, eos_token_ids=[eos], pad_token_id=eos, weights_lock=lock or WeightsLock(),
        version=version, on_batch=lambda n, _tokens, _s: sizes.append(n),
    ).engine
    assert isinstance(e, HFEngine)
    return e


def request(i: int, temperature: float = 1.0, max_tokens: int = 2) -> GenRequest:
    # stop ids that never come: each reply is exactly max_tokens long
    return GenRequest([5 + i, 6, 7, 8], max_tokens=max_tokens, temperature=temperature,
                      top_p=1.0)


def no_eos(e: HFEngine) -> HFEngine:
    e.eos_token_ids = [10**6]
    return e


async def serve(sizes: list[int], body: Callable[[Engine], Any], **generation: Any) -> None:
    e = no_eos(engine(sizes, **generation))
    e.start()
    try:
        await body(e)
    finally:
        await e.stop()


async def test_no_decode_step_holds_more_than_max_batch_size() -> None:
    sizes: list[int] = []
    replies = []

    async def body(e: Engine) -> None:
        replies.extend(await asyncio.gather(*(e.generate(request(i)) for i in range(8))))

    await serve(sizes, body, max_batch_size=3, batch_wait_ms=50)
    assert len(replies) == 8 and all(len(r.completion_ids) == 2 for r in replies)
    assert max(sizes) == 3 and sizes[0] == 3
    assert sum(sizes) == 8 * 2  # one row-step per token


async def test_one_batch_serves_every_sampling_setting() -> None:
    sizes: list[int] = []

    async def body(e: Engine) -> None:
        await asyncio.gather(*(
            e.generate(request(i, temperature=[0.0, 0.7, 1.0, 1.3][i])) for i in range(4)))

    await serve(sizes, body, max_batch_size=16, batch_wait_ms=50)
    assert sizes == [4, 4]


def batch_sizes_of_staggered_requests(batch_wait_ms: float) -> list[int]:
    """Four requests 0.3 s apart: a long enough wait gathers them before the first step."""
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
    # no wait: the first request starts alone (the others come later, while it runs)
    assert batch_sizes_of_staggered_requests(batch_wait_ms=0.0)[0] == 1
    assert batch_sizes_of_staggered_requests(batch_wait_ms=2000.0) == [4, 4]


async def test_a_request_joins_the_batch_under_way() -> None:
    """A short request that arrives while a long reply generates joins the running batch and
    is answered long before the long one ends (no waiting for the whole batch)."""
    sizes: list[int] = []
    done: dict[str, float] = {}

    async def body(e: Engine) -> None:
        async def ask(name: str, req: GenRequest) -> None:
            await e.generate(req)
            done[name] = time.monotonic()

        long = asyncio.ensure_future(ask("long", request(0, max_tokens=60)))
        while not sizes:
            await asyncio.sleep(0.005)
        await ask("short", request(1, max_tokens=2))
        await long

    await serve(sizes, body, max_batch_size=16, batch_wait_ms=0)
    assert done["short"] < done["long"]
    assert sizes.count(2) == 2  # the two shared exactly the short reply's two steps
    assert sum(sizes) == 60 + 2


async def test_a_groups_shared_prompt_is_computed_once() -> None:
    """G rollouts of one task ask with the same prompt: it is prefilled once, also for the
    members that arrive after the batch has started."""
    sizes: list[int] = []
    e = no_eos(engine(sizes, max_batch_size=16, batch_wait_ms=20))
    e.start()
    prompt = [5, 6, 7, 8, 9, 10]
    try:
        early = [asyncio.ensure_future(e.generate(GenRequest(prompt, 8, 1.0, 1.0)))
                 for _ in range(6)]
        while not sizes:
            await asyncio.sleep(0.005)
        late = [asyncio.ensure_future(e.generate(GenRequest(prompt, 8, 1.0, 1.0)))
                for _ in range(2)]
        await asyncio.gather(*early, *late)
        figures = e.take_figures()
    finally:
        await e.stop()
    assert figures["generate/requests"] == 8
    assert figures["generate/prompt_tokens"] == 8 * len(prompt)
    assert figures["generate/prefill_tokens"] == len(prompt)


def tokens(n: int, seed: int) -> list[int]:
    return torch.randint(5, 700, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


def kv_engine(attn: str = "eager", kv_cache_bytes: int = KV_CACHE_BYTES) -> HFEngine:
    """An engine without stop tokens (replies are exactly max_tokens long)."""
    model, _ = tiny(attn)
    return HFEngine(
        model, eos_token_ids=[10**6], pad_token_id=0, weights_lock=WeightsLock(),
        version=lambda: 0, max_batch_size=8, batch_wait_ms=0, kv_cache_bytes=kv_cache_bytes,
    )


async def ask(
    e: HFEngine, prompt: list[int], max_tokens: int = 8,
) -> tuple[GenResult, dict[str, float]]:
    """A greedy reply and the figures of serving it alone."""
    e.take_figures()
    reply = await e.generate(GenRequest(prompt, max_tokens, 0.0, 1.0))
    return reply, e.take_figures()


@pytest.mark.parametrize("attn", ["eager", "jetctl_tree"])
async def test_a_conversations_next_turn_prefills_only_what_is_new(attn: str) -> None:
    """Turn 2 (turn 1's prompt + its reply + the environment's answer) reuses turn 1's KV and
    computes only the rest; so does a turn 2 whose join differs from the sampled tokens. The
    replies equal those of an engine that keeps no KV, to the float tolerance."""
    first, answer = tokens(30, seed=1), tokens(10, seed=2)
    cached, alone = kv_engine(attn), kv_engine(attn, kv_cache_bytes=0)
    cached.start()
    alone.start()
    try:
        reply, _ = await ask(cached, first)
        sampled = reply.completion_ids  # 8 tokens; the last one never went through the model
        turns = {
            "extends the reply": (first + sampled + answer, len(answer) + 1),
            "rewrites its end": (first + sampled[:5] + answer, len(answer)),
        }
        for name, (prompt, computed) in turns.items():
            got, figures = await ask(cached, prompt)
            want, whole = await ask(alone, prompt)
            assert figures["generate/prefill_tokens"] == computed, name
            assert figures["generate/reused_tokens"] == len(prompt) - computed, name
            assert whole["generate/prefill_tokens"] == len(prompt), name
            assert whole["generate/reused_tokens"] == 0, name
            assert got.completion_ids == want.completion_ids, name
            assert got.completion_logprobs == pytest.approx(want.completion_logprobs,
                                                            abs=LOGPROB_TOL), name
    finally:
        await cached.stop()
        await alone.stop()


@pytest.mark.parametrize("attn", ["eager", "jetctl_tree"])
async def test_next_turns_admitted_together_compute_what_they_share_once(attn: str) -> None:
    """Two groups' next turns arrive together with nothing cached (an optimizer step emptied
    the cache): the system prompt both groups share, each group's question and each
    conversation's own reply and answer are computed once each, in that order, and the
    replies equal those of an engine that keeps no KV."""
    system = tokens(20, seed=4)
    questions = [tokens(30, seed=5), tokens(30, seed=6)]
    prompts = [system + q + tokens(10, seed=10 + 4 * g + i)
               for g, q in enumerate(questions) for i in range(4)]

    def make(kv_cache_bytes: int) -> HFEngine:
        model, _ = tiny(attn)
        return HFEngine(
            model, eos_token_ids=[10**6], pad_token_id=0, weights_lock=WeightsLock(),
            version=lambda: 0, max_batch_size=8, batch_wait_ms=100,
            kv_cache_bytes=kv_cache_bytes,
        )

    async def together(e: HFEngine) -> tuple[list[GenResult], dict[str, float]]:
        e.start()
        try:
            replies = await asyncio.gather(
                *[e.generate(GenRequest(p, 4, 0.0, 1.0)) for p in prompts])
            return list(replies), e.take_figures()
        finally:
            await e.stop()

    (got, figures), (small, scratch) = (
        await together(make(KV_CACHE_BYTES)), await together(make(0)))
    assert figures["generate/requests"] == 8 and figures["generate/prompt_tokens"] == 8 * 60
    assert figures["generate/prefill_tokens"] == 20 + 2 * 30 + 8 * 10
    assert figures["generate/reused_tokens"] == 8 * 50
    assert scratch["generate/prefill_tokens"] == figures["generate/prefill_tokens"], \
        "what an admission shares is computed once even where the cache keeps nothing"
    alone = make(0)  # one prompt at a time, nothing kept: every prompt computed whole
    alone.start()
    try:
        asked = [await ask(alone, p, max_tokens=4) for p in prompts]
    finally:
        await alone.stop()
    assert [f["generate/prefill_tokens"] for _, f in asked] == [60] * 8
    want = [reply for reply, _ in asked]
    for g, s, w in zip(got, small, want):
        assert g.completion_ids == s.completion_ids == w.completion_ids
        assert g.completion_logprobs == pytest.approx(w.completion_logprobs, abs=LOGPROB_TOL)
        assert s.completion_logprobs == pytest.approx(w.completion_logprobs, abs=LOGPROB_TOL)


@pytest.mark.parametrize("where", ["trainer's model", "replica"])
async def test_a_new_version_empties_the_kv_cache(where: str) -> None:
    """KV computed at one version is never used at the next, whether the engine reads the
    trainer's weights or gets them published to its replica: every token of a reply comes
    from the version it names."""
    model, _ = tiny()
    lock, version = WeightsLock(), [0]
    device = "cpu" if where == "replica" else None  # a replica of its own, published to
    cfg = ModelConfig(model="builtin:tiny",
                      generation=GenerationConfig(batch_wait_ms=0, device=device))
    serving = make_engine(cfg, model, eos_token_ids=[10**6], pad_token_id=0, weights_lock=lock,
                          version=lambda: version[0])
    assert isinstance(serving.engine, HFEngine)
    e = serving.engine
    e.start()
    prompt = tokens(30, seed=3)
    try:
        await ask(e, prompt)
        again, figures = await ask(e, prompt)
        assert figures["generate/prefill_tokens"] == 0  # the same version: all reused
        with lock:  # an optimizer step
            version[0] += 1
        if serving.publish is not None:
            serving.publish(version[0])
        after, figures = await ask(e, prompt)
    finally:
        await e.stop()
    assert (again.model_version, after.model_version) == (0, 1)
    assert figures["generate/prefill_tokens"] == len(prompt)
    assert figures["generate/reused_tokens"] == 0


async def test_the_kv_cache_keeps_to_its_bytes_least_recently_used_out_first() -> None:
    """Past its bound in bytes the cache lets go of the entry used longest ago."""
    model, _ = tiny()
    c = model.config
    head_dim = getattr(c, "head_dim", None) or c.hidden_size // c.num_attention_heads
    per_token = c.num_hidden_layers * 2 * c.num_key_value_heads * head_dim * 4  # K, V fp32
    entry = 20 * per_token + c.vocab_size * 4  # a 20-token prompt's KV and its logits
    e = kv_engine(kv_cache_bytes=int(2.5 * entry))  # room for two
    e.start()
    a, b, c3 = (tokens(20, seed=s) for s in (4, 5, 6))  # no common prefix
    try:
        for prompt in (a, b, c3):  # one-token replies: each leaves one 20-token entry
            await ask(e, prompt, max_tokens=1)
        _, newest = await ask(e, c3, max_tokens=1)
        _, oldest = await ask(e, a, max_tokens=1)
    finally:
        await e.stop()
    assert newest["generate/prefill_tokens"] == 0
    assert oldest["generate/prefill_tokens"] == len(a)  # evicted when c3 came


async def test_cancelled_requests_are_never_generated() -> None:
    """Requests cancelled while they wait (their rollout ended) are never admitted."""
    sizes: list[int] = []
    lock = WeightsLock()
    e = no_eos(engine(sizes, lock=lock, max_batch_size=16, batch_wait_ms=0))
    e.start()
    lock.acquire()  # an optimizer step: requests wait for the weights
    try:
        queued = [asyncio.ensure_future(e.generate(request(i))) for i in range(4)]
        await asyncio.sleep(0.1)
        queued[1].cancel()
        queued[2].cancel()
    finally:
        lock.release()
    try:
        await asyncio.gather(queued[0], queued[3])
        figures = e.take_figures()
        assert figures["generate/requests"] == 2
        assert sizes == [2, 2]
    finally:
        await e.stop()


async def test_a_waiting_optimizer_step_gets_the_weights_under_steady_load() -> None:
    """Requests keep coming; a thread that wants the weights (the trainer's step) gets them
    once the replies in flight end, and the replies after it carry the new version."""
    sizes: list[int] = []
    lock = WeightsLock()
    version = [0]
    e = no_eos(engine(sizes, lock=lock, version=lambda: version[0], max_batch_size=4,
                      batch_wait_ms=0))
    e.start()
    stepped = threading.Event()

    def optimizer_step() -> None:
        with lock:
            version[0] += 1
        stepped.set()

    replies = []
    try:
        load = [asyncio.ensure_future(e.generate(request(i % 8, max_tokens=6)))
                for i in range(4)]
        while not sizes:
            await asyncio.sleep(0.005)
        step = threading.Thread(target=optimizer_step)
        step.start()
        deadline = time.monotonic() + 30
        while not stepped.is_set() and time.monotonic() < deadline:
            load.append(asyncio.ensure_future(e.generate(request(len(load) % 8, max_tokens=6))))
            await asyncio.sleep(0.01)
        step.join(timeout=30)
        assert stepped.is_set(), "the trainer never got the weights under load"
        replies = await asyncio.gather(*load)
    finally:
        await e.stop()
    versions = [r.model_version for r in replies]
    assert versions[:4] == [0, 0, 0, 0] and versions[-1] == 1
    assert versions == sorted(versions)  # every request after the step got the new version



def test_a_seeded_request_draws_from_its_own_stream() -> None:
    """The OpenAI `seed`, honoured per request: a seeded reply is the same whatever else
    shares its batch and whatever torch's shared stream holds; another seed differs; and
    unseeded requests still sample freely."""

    def seeded(seed: int | None) -> GenRequest:
        return GenRequest([5, 6, 7, 8], max_tokens=8, temperature=1.0, top_p=1.0, seed=seed)

    async def body(e: Engine) -> None:
        torch.manual_seed(0)
        together = await asyncio.gather(
            e.generate(seeded(7)), e.generate(seeded(7)), e.generate(seeded(8)),
            *(e.generate(request(i, max_tokens=8)) for i in range(3)),
        )
        torch.manual_seed(123)
        alone = await e.generate(seeded(7))
        assert together[0].completion_ids == together[1].completion_ids == alone.completion_ids
        assert together[2].completion_ids != together[0].completion_ids
        free = [await e.generate(seeded(None)) for _ in range(3)]
        assert len({tuple(r.completion_ids) for r in free}) > 1

    asyncio.run(serve([], body))
