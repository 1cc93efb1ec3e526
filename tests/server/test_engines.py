"""The engine contract (`jetctl/server/engines/base.py`), checked on every engine that runs here.

Each engine serves builtin:tiny while a fake trainer changes the weights under the weights
lock; every reply must be explained by the weights of the version it names: its logprobs
equal the teacher-forced logprobs of that version's weights (float32, to 1e-4: batching and
left padding change only the order of float sums), and its tokens stop where the request
says. Cancelled requests leave the engine serving; a stopped engine fails what is queued.
"""

from __future__ import annotations

import asyncio
import threading
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field
from typing import Any

import pytest
import torch

from jetctl.recipe import GenerationConfig, ModelConfig
from jetctl.server.engines import Engine, GenRequest, GenResult, make_engine

pytestmark = [pytest.mark.unit, pytest.mark.timeout(120)]

LOGPROB_TOL = 1e-4  # fp32, tiny model: batched vs alone differ by ~1e-6; a version by ~1e-1


@dataclass
class Served:
    """An engine on builtin:tiny, the trainer-side model it serves, and each version's weights."""

    engine: Engine
    publish: Callable[[int], float] | None
    model: Any
    lock: threading.Lock
    eos: int
    versions: dict[int, dict[str, torch.Tensor]] = field(default_factory=dict)
    version: int = 0

    def step(self, seed: int) -> None:
        """A fake optimizer step: perturb every weight under the lock, version += 1, publish."""
        gen = torch.Generator().manual_seed(seed)
        with self.lock, torch.no_grad():
            for p in self.model.parameters():
                p.add_(0.05 * torch.randn(p.shape, generator=gen, dtype=p.dtype).to(p.device))
            self.version += 1
            self.versions[self.version] = _state(self.model)
        if self.publish is not None:
            self.publish(self.version)

    @torch.no_grad()
    def reference_logprobs(self, version: int, prompt: list[int], completion: list[int]) -> list[float]:
        """Teacher-forced untempered logprobs of `completion` under `version`'s weights."""
        current = _state(self.model)
        with self.lock:
            self.model.load_state_dict(self.versions[version])
            ids = torch.tensor([prompt + completion], device=self.model.device)
            logits = self.model(input_ids=ids).logits.float()[0].cpu()  # [T, V]
            self.model.load_state_dict(current)
        lp = torch.log_softmax(logits[len(prompt) - 1 : -1], dim=-1)
        return lp.gather(-1, torch.tensor(completion).unsqueeze(-1)).squeeze(-1).tolist()


def _state(model: Any) -> dict[str, torch.Tensor]:
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


# every engine that runs on a CPU (the CUDA runs are tests/gpu): hf on the trainer's model,
# hf on a replica (what a second GPU gets), and transformers' continuous batching
ENGINES: dict[str, dict[str, Any]] = {
    "hf": {"engine": "hf", "finetune": "full"},  # LoRA on hf gets a replica of the adapter
    "hf-replica": {"engine": "hf", "generation": GenerationConfig(device="cpu")},
    "continuous": {"engine": "continuous"},
}


def serve(engine: str, device: str = "cpu", **overrides: Any) -> Served:
    from jetctl.models import load_model

    model, tokenizer = load_model(
        "builtin:tiny", device=device, attn_implementation="jetctl_tree", progress=False
    )
    for p in model.parameters():
        p.requires_grad_(True)  # a full fine-tune: every tensor is published
    cfg = ModelConfig(model="builtin:tiny", device=device, **{**ENGINES[engine], **overrides})
    lock = threading.Lock()
    box: list[Served] = []
    serving = make_engine(
        cfg, model, eos_token_ids=[tokenizer.eos_token_id], pad_token_id=tokenizer.pad_token_id,
        weights_lock=lock, version=lambda: box[0].version if box else 0,
    )
    s = Served(serving.engine, serving.publish, model, lock, tokenizer.eos_token_id)
    s.versions[0] = _state(model)
    box.append(s)
    return s


@pytest.fixture(params=list(ENGINES))
async def served(request: pytest.FixtureRequest) -> AsyncIterator[Served]:
    s = serve(request.param)
    s.engine.start()
    yield s
    await s.engine.stop()


def prompts(n: int) -> list[list[int]]:
    gen = torch.Generator().manual_seed(7)
    return [torch.randint(5, 700, (3 + (i * 5) % 17,), generator=gen).tolist() for i in range(n)]


def check_reply(s: Served, req: GenRequest, res: GenResult, tol: float = LOGPROB_TOL) -> None:
    assert 1 <= len(res.completion_ids) <= req.max_tokens
    assert len(res.completion_logprobs) == len(res.completion_ids)
    stops = {s.eos, *req.stop_token_ids}
    if res.finish_reason == "stop":
        assert res.completion_ids[-1] in stops
        assert not stops & set(res.completion_ids[:-1])
    else:
        assert res.finish_reason == "length" and len(res.completion_ids) == req.max_tokens
        assert not stops & set(res.completion_ids)
    ref = s.reference_logprobs(res.model_version, req.prompt_ids, res.completion_ids)
    assert res.completion_logprobs == pytest.approx(ref, abs=tol)


async def test_concurrent_replies_are_their_versions_tokens_and_logprobs(served: Served) -> None:
    reqs = [GenRequest(p, max_tokens=12, temperature=1.0, top_p=1.0) for p in prompts(16)]
    results = await asyncio.gather(*(served.engine.generate(r) for r in reqs))
    for req, res in zip(reqs, results):
        assert res.model_version == 0
        check_reply(served, req, res)


async def test_each_reply_is_exact_to_the_version_it_names_while_weights_change(
    served: Served,
) -> None:
    reqs = [GenRequest(p, max_tokens=10, temperature=1.0, top_p=1.0) for p in prompts(24)]
    calls: list[asyncio.Task[GenResult]] = []
    for i, req in enumerate(reqs):
        calls.append(asyncio.create_task(served.engine.generate(req)))
        if i % 6 == 5:  # a step lands while requests are queued and running
            await asyncio.sleep(0.01)
            await asyncio.to_thread(served.step, seed=i)
    results = await asyncio.gather(*calls)
    seen = {r.model_version for r in results}
    assert len(seen) >= 2, f"the test never caught a weight change: versions {seen}"
    for req, res in zip(reqs, results):
        check_reply(served, req, res)
        # the check can fail: another version's weights do not explain the reply
        other = 0 if res.model_version else max(served.versions)
        wrong = served.reference_logprobs(other, req.prompt_ids, res.completion_ids)
        assert max(abs(a - b) for a, b in zip(res.completion_logprobs, wrong)) > 10 * LOGPROB_TOL


async def test_greedy_is_deterministic_and_stops_where_asked(served: Served) -> None:
    [prompt] = prompts(1)
    greedy = GenRequest(prompt, max_tokens=8, temperature=0.0, top_p=1.0)
    first, again = await asyncio.gather(served.engine.generate(greedy), served.engine.generate(greedy))
    assert first.completion_ids == again.completion_ids
    check_reply(served, greedy, first)
    stop_at = first.completion_ids[2]
    stopped = GenRequest(prompt, max_tokens=8, temperature=0.0, top_p=1.0, stop_token_ids=(stop_at,))
    res = await served.engine.generate(stopped)
    cut = first.completion_ids.index(stop_at) + 1
    assert (res.completion_ids, res.finish_reason) == (first.completion_ids[:cut], "stop")
    check_reply(served, stopped, res)


async def test_cancelled_requests_leave_the_engine_serving(served: Served) -> None:
    reqs = [GenRequest(p, max_tokens=12, temperature=1.0, top_p=1.0) for p in prompts(8)]
    doomed = [asyncio.create_task(served.engine.generate(r)) for r in reqs[:6]]
    await asyncio.sleep(0)  # queued (or running)
    for task in doomed:
        task.cancel()
    done = await asyncio.gather(*doomed, return_exceptions=True)
    assert all(isinstance(d, asyncio.CancelledError) for d in done)
    results = await asyncio.wait_for(
        asyncio.gather(*(served.engine.generate(r) for r in reqs[6:])), timeout=60
    )
    for req, res in zip(reqs[6:], results):
        check_reply(served, req, res)


async def test_stop_fails_what_is_under_way_instead_of_hanging(served: Served) -> None:
    reqs = [GenRequest(p, max_tokens=48, temperature=1.0, top_p=1.0) for p in prompts(64)]
    calls = [asyncio.create_task(served.engine.generate(r)) for r in reqs]
    # stop at the first reply: some ran, most (at least 64 - 16 rows) still run or wait (a
    # fixed sleep let a fast machine finish all of them first)
    await asyncio.wait_for(asyncio.wait(calls, return_when=asyncio.FIRST_COMPLETED), 60)
    await served.engine.stop()
    outcomes = await asyncio.wait_for(asyncio.gather(*calls, return_exceptions=True), timeout=30)
    failed = [o for o in outcomes if isinstance(o, BaseException)]
    assert failed and all("stopped" in str(o) for o in failed), failed[:3]
    for req, res in zip(reqs, outcomes):
        if isinstance(res, GenResult):
            check_reply(served, req, res)


async def test_hf_stop_fails_the_batch_waiting_for_the_weights() -> None:
    """The batch under way holds no result yet when the trainer holds the weights: stop must
    fail it too (it hung forever before)."""
    s = serve("hf")
    s.engine.start()
    s.lock.acquire()  # a long optimizer step: the running batch waits for the weights
    try:
        reqs = [GenRequest(p, max_tokens=4, temperature=1.0, top_p=1.0) for p in prompts(40)]
        calls = [asyncio.create_task(s.engine.generate(r)) for r in reqs]
        await asyncio.sleep(0.2)
        await s.engine.stop()
    finally:
        s.lock.release()
    outcomes = await asyncio.wait_for(asyncio.gather(*calls, return_exceptions=True), timeout=30)
    assert all(isinstance(o, RuntimeError) and "stopped" in str(o) for o in outcomes)


async def test_hf_stop_fails_requests_admitted_while_it_ran() -> None:
    """Requests the worker has taken off the queue are in no list `stop` reads until their
    prefill ends: stop must fail them too (they hung forever before: seen once in CI)."""
    s = serve("hf")
    engine = s.engine
    in_prefill, release = threading.Event(), threading.Event()
    prefill = engine._prefill  # type: ignore[attr-defined]

    def slow_prefill(plans: Any) -> Any:
        in_prefill.set()
        release.wait(10)
        return prefill(plans)

    engine._prefill = slow_prefill  # type: ignore[attr-defined]
    engine.start()
    reqs = [GenRequest(p, max_tokens=8, temperature=1.0, top_p=1.0) for p in prompts(6)]
    calls = [asyncio.create_task(engine.generate(r)) for r in reqs]
    assert await asyncio.to_thread(in_prefill.wait, 10), "the worker never admitted them"
    stopping = asyncio.create_task(engine.stop())
    await asyncio.sleep(0)  # stop runs up to its join: the queue and the batch are failed
    assert engine._stopping  # type: ignore[attr-defined]  # and the admitted are mid-prefill
    release.set()
    await stopping
    outcomes = await asyncio.wait_for(asyncio.gather(*calls, return_exceptions=True), timeout=30)
    assert all(isinstance(o, RuntimeError) and "stopped" in str(o) for o in outcomes), outcomes


def test_the_recipe_picks_the_engine() -> None:
    from jetctl.server.engines.hf import HFEngine

    engine = make_engine(
        ModelConfig(
            model="builtin:tiny", engine="hf", finetune="full",
            generation=GenerationConfig(max_batch_size=3),
        ),
        model=None, eos_token_ids=[2], pad_token_id=2, weights_lock=threading.Lock(),
        version=lambda: 0,
    )
    assert isinstance(engine.engine, HFEngine) and engine.engine.max_batch_size == 3
    assert engine.publish is None  # it reads the trainer's own weights


def test_a_lora_model_on_hf_generates_from_its_own_adapter_over_the_shared_base() -> None:
    from jetctl.models import load_model

    model, _ = load_model("builtin:tiny", attn_implementation="jetctl_tree", progress=False)
    for name, p in model.named_parameters():  # the adapter's place: what training changes
        p.requires_grad_("self_attn" in name)
    serving = make_engine(
        ModelConfig(model="builtin:tiny", engine="hf"), model, eos_token_ids=[2],
        pad_token_id=2, weights_lock=threading.Lock(), version=lambda: 0,
    )
    assert serving.publish is not None  # the trainer publishes; its step never waits
    replica = serving.publish.__self__  # type: ignore[attr-defined]
    assert replica.staged
    mine = dict(replica.model.named_parameters())
    for name, p in model.named_parameters():
        if p.requires_grad:  # the replica's own copy, equal until the trainer steps
            assert mine[name].data_ptr() != p.data_ptr() and torch.equal(mine[name], p), name
        else:  # the frozen base is held once
            assert mine[name] is p, name
    with torch.no_grad():
        next(p for p in model.parameters() if p.requires_grad).add_(1.0)
    changed = next(n for n, p in model.named_parameters() if p.requires_grad)
    assert not torch.equal(mine[changed], dict(model.named_parameters())[changed])
    serving.publish(1)
    assert torch.equal(mine[changed], dict(model.named_parameters())[changed])


def test_engine_vllm_needs_cuda_and_says_so() -> None:
    cfg = ModelConfig(model="builtin:tiny").model_copy(update={"engine": "vllm"})
    with pytest.raises(SystemExit, match="engine: vllm runs on CUDA.*use engine: hf"):
        make_engine(
            cfg, torch.nn.Linear(2, 2), eos_token_ids=[2], pad_token_id=2,
            weights_lock=threading.Lock(), version=lambda: 0,
        )


async def _fault_then_exact(
    s: Served, first: list[GenRequest], later: list[GenRequest],
    fault_hit: threading.Event | None = None, go: threading.Event | None = None,
) -> None:
    """`first` meet the injected fault: those it reached fail with it, the others are
    whole; `later` are then served exactly by a live worker. With `fault_hit`/`go`, `later`
    are queued while the fault is held open, so the worker meets them right after it."""
    engine = s.engine
    engine.start()
    try:
        calls = [asyncio.create_task(engine.generate(r)) for r in first]
        queued: list[asyncio.Task[GenResult]] = []
        if fault_hit is not None and go is not None:
            assert await asyncio.to_thread(fault_hit.wait, 30), "the fault was never reached"
            queued = [asyncio.create_task(engine.generate(r)) for r in later]
            while len(engine._incoming) < len(later):  # type: ignore[attr-defined]
                await asyncio.sleep(0)  # the tasks run up to their wait: they are queued
            go.set()
        outcomes = await asyncio.wait_for(asyncio.gather(*calls, return_exceptions=True), 60)
        failed = [o for o in outcomes if isinstance(o, BaseException)]
        assert failed and all("injected" in str(o) for o in failed), outcomes
        for req, res in zip(first, outcomes):  # a reply that ended before the fault is whole
            if isinstance(res, GenResult):
                check_reply(s, req, res)
        assert engine._thread is not None and engine._thread.is_alive()  # type: ignore[attr-defined]
        if not queued:
            queued = [asyncio.create_task(engine.generate(r)) for r in later]
        results = await asyncio.wait_for(asyncio.gather(*queued), 60)
        for req, res in zip(later, results):
            check_reply(s, req, res)
    finally:
        await engine.stop()


def _requests(prompt_ids: list[list[int]]) -> list[GenRequest]:
    return [GenRequest(p, max_tokens=8, temperature=1.0, top_p=1.0) for p in prompt_ids]


async def test_hf_a_failed_step_fails_its_batch_and_the_next_batch_is_exact() -> None:
    """A forward that raises fails its replies; the batch the worker admits next must not
    be merged beside the failed batch's KV (it failed too, or mixed rows, before)."""
    s = serve("hf")
    decode, calls = s.engine._decode_step, [0]  # type: ignore[attr-defined]
    fault_hit, go = threading.Event(), threading.Event()

    def flaky_decode(state: Any, version: int) -> None:
        calls[0] += 1
        if calls[0] == 3:
            fault_hit.set()
            go.wait(30)  # the next requests are queued: the worker admits them at once
            raise RuntimeError("injected: a decode step failed")
        decode(state, version)

    s.engine._decode_step = flaky_decode  # type: ignore[attr-defined]
    await _fault_then_exact(s, _requests(prompts(5)), _requests(prompts(9)[2:]), fault_hit, go)


async def test_hf_a_fault_outside_a_forward_fails_the_batch_and_the_worker_serves_on() -> None:
    """An exception in the worker between forwards used to end its thread: every later
    request then waited forever (and a server neither trained nor drained)."""
    s = serve("hf")
    drop, calls = s.engine._drop_cancelled, [0]  # type: ignore[attr-defined]

    def flaky_drop(state: Any) -> None:
        calls[0] += 1
        if calls[0] == 2:
            raise RuntimeError("injected: a fault between forwards")
        drop(state)

    s.engine._drop_cancelled = flaky_drop  # type: ignore[attr-defined]
    await _fault_then_exact(s, _requests(prompts(4)), _requests(prompts(6)))
