"""HF transformers inference engine with dynamic batching.

Concurrent Generate calls queue up; a batcher takes every waiting request with the same
sampling parameters (up to `max_batch_size`, waiting at most `batch_wait_ms` for company)
and runs them as one left-padded `model.generate` in a worker thread, so the asyncio
server keeps answering while the model works. A batch runs entirely at one model version
(it holds the weights lock the trainer takes for its optimizer step), so the version in
each reply is exact.

Logprobs are of the untempered policy (log_softmax of the raw logits) at each sampled
token: with temperature 1 they are the behaviour logprobs PPO-clip needs.

Left out: continuous batching and paged KV (the vLLM engine's job), speculative decoding.
"""

from __future__ import annotations

import asyncio
import threading
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any

import torch
from transformers import GenerationConfig

from jetctl.server.engines.base import GenRequest, GenResult


@dataclass
class _Pending:
    req: GenRequest
    future: asyncio.Future[GenResult]
    enqueued: float = field(default_factory=time.monotonic)


class HFEngine:
    """Batches concurrent requests onto one HF model shared with the trainer."""

    def __init__(
        self,
        model: Any,
        *,
        eos_token_ids: list[int],
        pad_token_id: int,
        weights_lock: threading.Lock,
        version: Callable[[], int],
        max_batch_size: int,
        batch_wait_ms: float,
        on_batch: Callable[[int, int, float], None] | None = None,
    ) -> None:
        self.model = model
        self.eos_token_ids = eos_token_ids
        self.pad_token_id = pad_token_id
        self._lock = weights_lock
        self._version = version
        self.max_batch_size = max_batch_size
        self.batch_wait_s = batch_wait_ms / 1000.0
        self._on_batch = on_batch  # (batch size, tokens generated, seconds)
        self._queue: list[_Pending] = []
        self._running: list[_Pending] = []  # the batch under way (failed by stop, not lost)
        self._wakeup: asyncio.Event | None = None
        self._executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="engine")
        self._task: asyncio.Task[None] | None = None
        self.busy_since: float | None = None  # monotonic start of the batch under way (watchdog)

    def start(self) -> None:
        self._wakeup = asyncio.Event()
        self._task = asyncio.get_running_loop().create_task(self._batch_loop())

    async def stop(self) -> None:
        if self._task:
            self._task.cancel()
        for p in self._queue + self._running:
            if not p.future.done():
                p.future.set_exception(RuntimeError("engine stopped"))
        self._executor.shutdown(wait=False, cancel_futures=True)

    async def generate(self, req: GenRequest) -> GenResult:
        assert self._wakeup is not None, "engine not started"
        fut: asyncio.Future[GenResult] = asyncio.get_running_loop().create_future()
        self._queue.append(_Pending(req, fut))
        self._wakeup.set()
        return await fut

    async def _batch_loop(self) -> None:
        assert self._wakeup is not None
        loop = asyncio.get_running_loop()
        while True:
            await self._wakeup.wait()
            self._wakeup.clear()
            if not self._queue:
                continue
            # give concurrent callers a moment to join the batch
            if len(self._queue) < self.max_batch_size and self.batch_wait_s > 0:
                await asyncio.sleep(self.batch_wait_s)
            batch = self._take_batch()
            if self._queue:
                self._wakeup.set()
            live = [p for p in batch if not p.future.cancelled()]
            if not live:
                continue
            self.busy_since = time.monotonic()
            self._running = live
            try:
                results = await loop.run_in_executor(
                    self._executor, self._generate_batch, [p.req for p in live]
                )
            except Exception as exc:  # noqa: BLE001 - a failed batch fails its callers, not the engine
                for p in live:
                    if not p.future.done():
                        p.future.set_exception(exc)
                continue
            finally:
                self.busy_since = None
                self._running = []
            for p, r in zip(live, results):
                if not p.future.done():
                    p.future.set_result(r)

    def _take_batch(self) -> list[_Pending]:
        first = self._queue[0]
        key = (first.req.temperature, first.req.top_p)
        batch: list[_Pending] = []
        rest: list[_Pending] = []
        for p in self._queue:
            if len(batch) < self.max_batch_size and (p.req.temperature, p.req.top_p) == key:
                batch.append(p)
            else:
                rest.append(p)
        self._queue = rest
        return batch

    @torch.no_grad()
    def _generate_batch(self, reqs: list[GenRequest]) -> list[GenResult]:
        t0 = time.monotonic()
        width = max(len(r.prompt_ids) for r in reqs)
        input_ids = torch.full((len(reqs), width), self.pad_token_id, dtype=torch.long)
        attention = torch.zeros((len(reqs), width), dtype=torch.long)
        for i, r in enumerate(reqs):  # left padding
            input_ids[i, width - len(r.prompt_ids) :] = torch.tensor(r.prompt_ids)
            attention[i, width - len(r.prompt_ids) :] = 1
        max_new = max(max(r.max_tokens, 1) for r in reqs)
        temperature = reqs[0].temperature
        # an explicit config: a checkpoint's own generation defaults (top_k=50,
        # repetition penalties) would change the sampling distribution silently
        config = GenerationConfig(
            do_sample=temperature > 0,
            temperature=temperature if temperature > 0 else None,
            top_p=reqs[0].top_p if temperature > 0 else None,
            top_k=None,
            max_new_tokens=max_new,
            eos_token_id=self.eos_token_ids,
            pad_token_id=self.pad_token_id,
            output_logits=True,
            return_dict_in_generate=True,
        )
        with self._lock:
            version = self._version()
            out = self.model.generate(
                input_ids=input_ids, attention_mask=attention, generation_config=config
            )
        new_tokens = out.sequences[:, width:]  # [B, T_new]
        logits = torch.stack(out.logits, dim=1).float()  # [B, T_new, V]
        logprobs = torch.log_softmax(logits, dim=-1).gather(-1, new_tokens.unsqueeze(-1))
        logprobs = logprobs.squeeze(-1)  # [B, T_new]
        results = [
            self._finish(r, new_tokens[i].tolist(), logprobs[i].tolist(), version)
            for i, r in enumerate(reqs)
        ]
        if self._on_batch:
            n_tokens = sum(len(r.completion_ids) for r in results)
            self._on_batch(len(reqs), n_tokens, time.monotonic() - t0)
        return results

    def _finish(
        self, req: GenRequest, ids: list[int], lps: list[float], version: int
    ) -> GenResult:
        stops = set(self.eos_token_ids) | set(req.stop_token_ids)
        limit = max(req.max_tokens, 1)
        for j, tok in enumerate(ids[:limit]):
            if tok in stops:
                return GenResult(ids[: j + 1], lps[: j + 1], version, "stop")
        return GenResult(ids[:limit], lps[:limit], version, "length")
