"""Inference engines behind one contract (`base.Engine`), picked by `models.<m>.engine`.

    hf    engines/hf.py: dynamic batching of HF `generate` on the trainer's own model object

`make_engine` is the only place that knows the names; the service sees an `Engine`.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from typing import Any

from jetctl.recipe import ModelConfig
from jetctl.server.engines.base import Engine, GenRequest, GenResult

__all__ = ["Engine", "GenRequest", "GenResult", "make_engine"]


def make_engine(
    cfg: ModelConfig,
    model: Any,
    *,
    eos_token_ids: list[int],
    pad_token_id: int,
    weights_lock: threading.Lock,
    version: Callable[[], int],
    on_batch: Callable[[int, int, float], None] | None = None,
) -> Engine:
    """The engine `cfg.engine` names, serving `model` (shared with the trainer)."""
    if cfg.engine == "hf":
        from jetctl.server.engines.hf import HFEngine

        return HFEngine(
            model, eos_token_ids=eos_token_ids, pad_token_id=pad_token_id,
            weights_lock=weights_lock, version=version,
            max_batch_size=cfg.generation.max_batch_size,
            batch_wait_ms=cfg.generation.batch_wait_ms, on_batch=on_batch,
        )
    raise ValueError(
        f"engine: {cfg.engine!r} is not available in this server yet; use engine: hf"
    )
