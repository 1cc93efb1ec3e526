"""Inference engines behind one contract (`base.Engine`), picked by `models.<m>.engine`.

    hf          engines/hf.py: continuous batching (newcomers join between decode steps) on
                the trainer's own model object (finetune: full), or on a replica: with
                LoRA (the adapter copied, the frozen base shared; publishes staged), when
                `generation.device` is set (a second GPU) or the engine generates in
                another dtype than the model's (`generation.dtype`; engines/dtype.py:
                what `auto` picks here); `generation.workers: N` runs N of them, each on
                its own replica (engines/workers.py)
    continuous  engines/continuous.py: transformers' continuous batching + paged KV cache,
                always on a replica (`generation.device`, else the trainer's device)
    vllm        engines/vllm.py: vLLM's AsyncLLM (EXPERIMENTAL: not yet run on a GPU)

`make_engine` is the only place that knows the names. It returns the engine and, for an
engine with its own copy of the weights, the `publish(version)` the trainer calls after
each optimizer step (engines/replica.py: under `generation.publish_timeout_s`).
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from jetctl.server.engines.base import Engine, GenRequest, GenResult
from jetctl.server.engines.dtype import GenerationDtype, pick_generation_dtype
from jetctl.server.locks import WeightsLock

if TYPE_CHECKING:  # the engines import without pydantic (scripts/gpu_check.sh)
    from jetctl.recipe import ModelConfig

__all__ = ["Engine", "GenRequest", "GenResult", "ServingEngine", "make_engine"]


@dataclass
class ServingEngine:
    engine: Engine
    publish: Callable[[int], float] | None  # None: the engine reads the trainer's weights
    dtype: GenerationDtype  # what it generates in, and why


def make_engine(
    cfg: ModelConfig,
    model: Any,
    *,
    eos_token_ids: list[int],
    pad_token_id: int,
    weights_lock: threading.Lock | WeightsLock,
    version: Callable[[], int],
    on_batch: Callable[[int, int, float], None] | None = None,
    threads: int | None = None,
    lent_threads: Callable[[], int] | None = None,
) -> ServingEngine:
    """The engine `cfg.engine` names, serving `model` (the trainer's) at `version()`.

    `threads`: torch threads of each of the engine's workers (hf), else `generation.threads`;
    `lent_threads`: how many more the hf worker may use right now (`train.lend_threads`:
    the trainer's, while it computes no step).
    """
    from jetctl.server.engines.hf import HFEngine
    from jetctl.server.engines.replica import Replica

    gen = cfg.generation
    threads = threads or gen.threads
    if threads and gen.workers > 1:  # generation's threads shared out, at least one each
        threads = max(1, threads // gen.workers)
    dtype = pick_generation_dtype(
        gen.dtype, model, model_dtype=cfg.dtype, engine=cfg.engine,
        device=gen.device or cfg.device, threads=threads,
    )
    # a device or a dtype of its own gives the engine a copy of the weights (a replica); so
    # does a LoRA model on hf: the copy shares the frozen base and holds its own adapter, so
    # the trainer's optimizer step never waits for the engine's batch to drain
    same = gen.device is None and dtype.dtype is None
    if cfg.engine == "hf" and same and cfg.finetune != "lora" and gen.workers == 1:
        return ServingEngine(
            HFEngine(
                model, eos_token_ids=eos_token_ids, pad_token_id=pad_token_id,
                weights_lock=weights_lock, version=version,
                max_batch_size=gen.max_batch_size, batch_wait_ms=gen.batch_wait_ms,
                on_batch=on_batch, threads=threads, lent_threads=lent_threads,
            ),
            publish=None, dtype=dtype,
        )
    if cfg.engine == "vllm":
        from jetctl.server.engines.vllm import VLLMEngine

        vllm = VLLMEngine(cfg, model, eos_token_ids=eos_token_ids, version=version())
        return ServingEngine(vllm, publish=vllm.publish, dtype=dtype)

    def hf_on_replica() -> tuple[HFEngine, Replica]:
        # hf: held around each decode step (a waiting publish stops admissions)
        lock = WeightsLock()
        replica = Replica(
            model, device=gen.device or cfg.device, version=version(),
            timeout_s=gen.publish_timeout_s, gate=lock, dtype=dtype.dtype,
            staged=True,  # the trainer stages a step's weights and goes on
            share_frozen=same,
        )
        engine = HFEngine(
            replica.model, eos_token_ids=eos_token_ids, pad_token_id=pad_token_id,
            weights_lock=lock, version=replica.serving_version, max_batch_size=gen.max_batch_size,
            batch_wait_ms=gen.batch_wait_ms, on_batch=on_batch, threads=threads,
            staged=replica if replica.staged else None, lent_threads=lent_threads,
        )
        return engine, replica

    if cfg.engine == "hf" and gen.workers > 1:  # engines/workers.py: N batches at once
        from jetctl.server.engines.workers import EngineWorkers

        pairs = [hf_on_replica() for _ in range(gen.workers)]
        workers = EngineWorkers([e for e, _ in pairs], [r for _, r in pairs])
        return ServingEngine(workers, publish=workers.publish, dtype=dtype)
    if cfg.engine == "hf":
        engine, replica = hf_on_replica()
        return ServingEngine(engine, publish=replica.publish, dtype=dtype)
    # continuous: the gate is replaced by the engine's drain
    replica = Replica(
        model, device=gen.device or cfg.device, version=version(),
        timeout_s=gen.publish_timeout_s, gate=WeightsLock(), dtype=dtype.dtype,
        staged=False, share_frozen=same,
    )
    from jetctl.server.engines.continuous import ContinuousEngine

    continuous = ContinuousEngine(
        replica, eos_token_ids=eos_token_ids, pad_token_id=pad_token_id,
        max_batch_size=gen.max_batch_size, max_new_tokens=gen.max_new_tokens,
        batch_wait_ms=gen.batch_wait_ms, on_batch=on_batch,
    )
    return ServingEngine(continuous, publish=replica.publish, dtype=dtype)
