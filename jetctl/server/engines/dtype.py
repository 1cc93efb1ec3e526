"""`generation.dtype`: the dtype the engine generates in, and what `auto` picks on this host.

A decode step at a few rows is bound by reading the weights, and bfloat16 halves the bytes,
but only hardware that computes in bfloat16 natively turns that into speed. Measured on two
2-core VMs, SmolLM2-135M, one thread, a decode step at 14 rows: on a Xeon with avx512_bf16,
74 ms in bfloat16 against 104 ms in float32; on an AVX2-only EPYC, 527 ms against 192 (the
bfloat16 matmuls are emulated). A fixed choice is wrong on one of them, so `auto` measures
instead of guessing: it times the model's largest matrix (the vocabulary projection, read
once per decode step) at 16 rows in both dtypes, on the engine's threads, and generates in
bfloat16 where that takes at most `BF16_GAIN` of float32's time. On a CUDA device it takes
bfloat16 where the device supports it. It never picks a dtype for engine vllm (vLLM loads the
model's dtype) or for a model that is not float32.

    pick_generation_dtype(generation.dtype, model, model_dtype=, engine=, device=, threads=)
        ->  GenerationDtype(dtype, why)

Left out: float16 (never picked by `auto`; set it by name), and a probe of the whole model
(the matrix alone decides in under a second; the step's other work follows the same kernels).
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

BF16_GAIN = 0.85  # bfloat16 only where the probe runs in at most this share of float32's time
PROBE_ROWS = 16  # a decode step's rows (generation.max_batch_size's default)


@dataclass(frozen=True)
class GenerationDtype:
    dtype: str | None  # the engine's own dtype; None: the model's (no copy needed for it)
    why: str  # for the server's log: what was set or measured


def probe_matmul(weight: torch.Tensor, dtype: torch.dtype, rows: int = PROBE_ROWS) -> float:
    """Seconds of one `[rows, in] x [out, in]^T` product in `dtype`: the best of 3 rounds, each
    of enough products to last about 5 ms (a small model's matrix takes microseconds)."""
    w = weight.detach().to(dtype)
    x = torch.randn(rows, w.shape[1], dtype=torch.float32).to(dtype)
    with torch.no_grad():
        t0 = time.perf_counter()
        torch.nn.functional.linear(x, w)  # warm: kernel selection, first touch of the pages
        n = min(1000, max(1, int(0.005 / max(time.perf_counter() - t0, 1e-7))))
        best = float("inf")
        for _ in range(3):
            t0 = time.perf_counter()
            for _ in range(n):
                torch.nn.functional.linear(x, w)
            best = min(best, (time.perf_counter() - t0) / n)
    return best


def _largest_matrix(model: Any) -> torch.Tensor:
    return max(
        (p for p in model.parameters() if p.dim() == 2 and p.is_floating_point()),
        key=lambda p: p.numel(),
    )


def pick_generation_dtype(
    asked: str | None,
    model: Any,
    *,
    model_dtype: str,
    engine: str,
    device: str,
    threads: int | None = None,
    probe: Callable[[torch.Tensor, torch.dtype], float] = probe_matmul,
) -> GenerationDtype:
    """`asked` (a `generation.dtype`) for a `model_dtype` model served by `engine` on `device`."""
    if asked is None:
        return GenerationDtype(None, f"the model's dtype ({model_dtype})")
    if asked != "auto":
        own = asked if asked != model_dtype else None
        return GenerationDtype(own, f"generation.dtype {asked}")
    if engine == "vllm":
        return GenerationDtype(None, f"auto: engine vllm generates in the model's dtype ({model_dtype})")
    if model_dtype != "float32":
        return GenerationDtype(None, f"auto: the model is already {model_dtype}")
    where = torch.device(device)
    if where.type == "cuda":
        if torch.cuda.is_available() and torch.cuda.is_bf16_supported():
            return GenerationDtype("bfloat16", f"auto: {where} supports bfloat16")
        return GenerationDtype(None, f"auto: float32 ({where} lacks bfloat16)")
    if where.type != "cpu":
        return GenerationDtype(None, f"auto: float32 (no probe for {where.type})")
    weight = _largest_matrix(model)
    saved = torch.get_num_threads()
    if threads:
        torch.set_num_threads(threads)
    try:
        fp32 = probe(weight, torch.float32)
        bf16 = probe(weight, torch.bfloat16)
    finally:
        torch.set_num_threads(saved)
    pick = "bfloat16" if bf16 <= BF16_GAIN * fp32 else None
    shape = "x".join(str(n) for n in weight.shape)
    return GenerationDtype(
        pick,
        f"auto: {pick or 'float32'} (a {PROBE_ROWS}-row product with the {shape} matrix took "
        f"{bf16 * 1e3:.3g} ms in bfloat16 against {fp32 * 1e3:.3g} ms in float32 on this CPU; "
        f"bfloat16 is taken at <= {BF16_GAIN:.2f}x)",
    )
