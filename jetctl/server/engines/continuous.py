"""Continuous batching with a paged KV cache, from transformers, on a replica of the weights.

`engine: continuous` serves `Generate` through transformers' `ContinuousBatchingManager`
(`model.init_continuous_batching`): one background loop schedules every request's prefill
and decode steps into shared forwards over a paged KV cache, so a request joins and leaves
the batch at any step instead of waiting for a padded batch to finish. It is the fast path
on CUDA; on a CPU it is slower than `engine: hf` (about 6x for 16 short requests), so `hf`
stays the CPU default.

Exactness, with the loop never stopping between requests:

- weights: the engine serves a `Replica` (engines/replica.py) and never the trainer's
  model object. A publish closes admission, waits until no admitted request is still in
  flight (the drain is bounded by the publish deadline), pauses the loop, copies, forgets
  every cached KV block (prefix sharing would otherwise reuse blocks computed with the old
  weights), then reopens. A request is admitted at one version and finishes at it.
- logprobs: with temperature 1 and top_p 1 the manager runs no logits processor, so the
  logprob it returns for each sampled token is log softmax of the raw logits: the behaviour
  logprob (checked against teacher forcing in tests/server/test_engines.py). Requests with
  other sampling parameters (greedy, tempered, nucleus) would get the processed
  distribution's logprobs, so they go to an `HFEngine` on the same replica instead (plain
  `generate`, same gate), which returns untempered logprobs like every engine here.
- cancellation: a cancelled caller cancels its request in the manager.

Left out: per-request sampling parameters inside the continuous loop (see above), CUDA
graphs and torch.compile settings beyond transformers' defaults, and KV-cache offloading.
The KV cache takes `cache_memory_fraction` of the device memory free after loading (the
trainer needs the rest when they share a GPU).
"""

from __future__ import annotations

import asyncio
import logging
import threading
import time
import uuid
from collections.abc import Callable
from typing import Any

from jetctl.server.engines.base import EngineLoad, GenRequest, GenResult
from jetctl.server.engines.hf import HFEngine
from jetctl.server.engines.replica import Replica

log = logging.getLogger("jetctl.server.engines")
ADMIT_POLL_S = 0.005  # how often a request held back by a publish looks again


class _DrainGate:
    """The replica's gate: closing it waits until no admitted request is in flight.

    `admit` (event loop) and `acquire` (trainer thread) meet under one condition, so a
    request is counted in flight exactly when it is admitted at the replica's version.
    """

    def __init__(self, on_closed: Callable[[float], bool], on_open: Callable[[], None]) -> None:
        self._cond = threading.Condition()
        self._closed = False
        self.in_flight = 0
        self._on_closed = on_closed  # drained: take the rest (seconds left); False: missed
        self._on_open = on_open  # called before reopening

    def try_admit(self) -> bool:
        with self._cond:
            if self._closed:
                return False
            self.in_flight += 1
            return True

    def done(self) -> None:
        with self._cond:
            self.in_flight -= 1
            self._cond.notify_all()

    def acquire(self, blocking: bool = True, timeout: float = -1) -> bool:
        deadline = time.monotonic() + (timeout if timeout >= 0 else 1e9)
        with self._cond:
            self._closed = True
            drained = self._cond.wait_for(
                lambda: self.in_flight == 0, max(0.0, deadline - time.monotonic())
            )
            if not drained:
                self._closed = False
                return False
        taken = False
        try:
            taken = self._on_closed(max(0.0, deadline - time.monotonic()))
        finally:
            if not taken:
                with self._cond:
                    self._closed = False
        return taken

    def release(self) -> None:
        try:
            self._on_open()
        finally:
            with self._cond:
                self._closed = False


class ContinuousEngine:
    """transformers' continuous batching on `replica.model`; exact versions by draining."""

    def __init__(
        self,
        replica: Replica,
        *,
        eos_token_ids: list[int],
        pad_token_id: int,
        max_batch_size: int,
        max_new_tokens: int,
        batch_wait_ms: float,
        page_size: int = 256,
        cache_memory_fraction: float = 0.3,
        on_batch: Callable[[int, int, float], None] | None = None,  # fallback batches only
    ) -> None:
        self.replica = replica
        self.eos_token_ids = eos_token_ids
        self.pad_token_id = pad_token_id
        self.max_batch_size = max_batch_size
        self.max_new_tokens = max_new_tokens
        self.page_size = page_size
        self.cache_memory_fraction = cache_memory_fraction
        self._manager: Any = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._pending: dict[str, tuple[asyncio.Future[Any], float]] = {}  # id -> (future, start)
        self._pause: Any = None  # the manager's pause context while a publish copies
        self._stopped = False
        self._fallback_lock = threading.Lock()
        self._gate = _DrainGate(on_closed=self._enter_publish, on_open=self._leave_publish)
        replica.set_gate(self._gate)
        # other sampling parameters: plain generate on the same replica (module docstring)
        self.fallback = HFEngine(
            replica.model, eos_token_ids=eos_token_ids, pad_token_id=pad_token_id,
            weights_lock=self._fallback_lock, version=replica.serving_version,
            max_batch_size=max_batch_size, batch_wait_ms=batch_wait_ms, on_batch=on_batch,
        )

    # --- lifecycle -------------------------------------------------------------------

    def start(self) -> None:
        from transformers import GenerationConfig
        from transformers.generation.configuration_utils import ContinuousBatchingConfig

        self._loop = asyncio.get_running_loop()
        model = self.replica.model
        base = model.get_base_model() if hasattr(model, "get_base_model") else model
        # jetctl_tree (training's kernel) is not one continuous batching accepts; sdpa is,
        # and transformers switches to flash attention by itself where it is installed
        base.set_attn_implementation("sdpa")
        # an explicit config: no logits processor at all (temperature 1, top_p 1, no top_k,
        # no repetition penalty), so the returned logprobs are of the raw logits
        generation = GenerationConfig(
            do_sample=True, temperature=None, top_p=None, top_k=None,
            max_new_tokens=self.max_new_tokens, eos_token_id=self.eos_token_ids,
            pad_token_id=self.pad_token_id,
        )
        cb = ContinuousBatchingConfig(
            return_logprobs=True, page_size=self.page_size,
            max_memory_percent=self.cache_memory_fraction,
            max_requests_per_batch=self.max_batch_size,
        )
        self._manager = base.init_continuous_batching(
            generation_config=generation, continuous_batching_config=cb
        )
        self._manager.start()
        self.fallback.start()

    async def stop(self) -> None:
        self._stopped = True
        for fut, _ in list(self._pending.values()):
            if not fut.done():
                fut.set_exception(RuntimeError("engine stopped"))
        if self._manager is not None:
            await asyncio.to_thread(self._manager.stop, block=True, timeout=10)
        await self.fallback.stop()

    @property
    def busy_since(self) -> float | None:
        """Start of the oldest request in flight (the server's stall watchdog reads it)."""
        starts = [start for _, start in self._pending.values()]
        if self.fallback.busy_since is not None:
            starts.append(self.fallback.busy_since)
        return min(starts, default=None)

    # --- generation ------------------------------------------------------------------

    def load(self) -> EngineLoad:
        """Requests in flight; transformers' manager batches them as it sees fit (no row
        count or queue of its own is exposed)."""
        return EngineLoad(rows=len(self._pending))

    async def generate(self, req: GenRequest) -> GenResult:
        assert self._manager is not None and self._loop is not None, "engine not started"
        if req.temperature != 1.0 or req.top_p != 1.0 or req.seed is not None:
            return await self.fallback.generate(req)  # its sampling, per-request seeds included
        while not self._gate.try_admit():  # a publish is draining or copying
            if self._stopped:
                raise RuntimeError("engine stopped")
            await asyncio.sleep(ADMIT_POLL_S)
        rid = uuid.uuid4().hex
        fut: asyncio.Future[Any] = self._loop.create_future()
        self._pending[rid] = (fut, time.monotonic())
        try:
            version = self.replica.serving_version()
            stops = sorted(set(self.eos_token_ids) | set(req.stop_token_ids))
            self._manager.register_result_handler(rid, lambda out: self._deliver(fut, out))
            added = self._manager.add_request(
                list(req.prompt_ids), request_id=rid, max_new_tokens=max(req.max_tokens, 1),
                eos_token_id=stops,
            )
            if added is None:
                raise RuntimeError("the continuous batching loop refused the request (stopping)")
            out = await fut
        except asyncio.CancelledError:
            self._manager.cancel_request(rid)
            with self._manager.output_router._lock:  # no reply will come for it
                self._manager.output_router.result_handlers.pop(rid, None)
            raise
        finally:
            self._pending.pop(rid, None)
            self._gate.done()
        if out.error is not None:
            raise RuntimeError(f"continuous batching failed the request: {out.error}")
        ids, lps = list(out.generated_tokens), list(out.logprobs)
        if len(lps) != len(ids):
            raise RuntimeError(f"continuous batching returned {len(lps)} logprobs for {len(ids)} tokens")
        finish = "stop" if ids and ids[-1] in set(stops) else "length"
        return GenResult(ids, lps, version, finish)

    @staticmethod
    def _deliver(fut: asyncio.Future[Any], out: Any) -> None:
        if out.is_finished() and not fut.done():
            fut.set_result(out)

    # --- publish (the replica's gate calls these from the trainer thread) -------------

    def _enter_publish(self, timeout_s: float) -> bool:
        """Drained: also hold the fallback's lock and the paused loop while the copy runs."""
        if not self._fallback_lock.acquire(timeout=timeout_s):
            return False  # a fallback batch is still running: a missed deadline
        try:
            self._pause = self._manager.pause()
            self._pause.__enter__()
        except BaseException:
            self._fallback_lock.release()
            raise
        return True

    def _leave_publish(self) -> None:
        try:
            processor = self._manager.batch_processor
            if processor is not None:  # blocks cached for prefix sharing hold old-weight KV
                processor.cache.reset()
        finally:
            pause, self._pause = self._pause, None
            try:
                if pause is not None:
                    pause.__exit__(None, None, None)
            finally:
                self._fallback_lock.release()

