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

The probe's two figures are kept per CPU model in `$JETCTL_CACHE/generation-dtype.json`
(default `~/.cache/jetctl`), keyed by the CPU's name, the torch version, the matrix's shape and
the threads: a server's later starts on the same kind of CPU read them instead of measuring
again (about a second of a quickstart server's start on a 2-core EPYC). Delete the file to
measure again.

Left out: float16 (never picked by `auto`; set it by name), and a probe of the whole model
(the matrix alone decides in under a second; the step's other work follows the same kernels).
"""

from __future__ import annotations

import json
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

BF16_GAIN = 0.85  # bfloat16 only where the probe runs in at most this share of float32's time
PROBE_ROWS = 16  # a decode step's rows (generation.max_batch_size's default)
PROBE_CACHE = "generation-dtype.json"  # under jetctl.models.cache_dir()


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
    shape = "x".join(str(n) for n in weight.shape)
    # only the real probe's figures are kept (a test's stand-in is asked every time)
    key = _probe_key(shape, threads or torch.get_num_threads()) if probe is probe_matmul else ""
    kept = _kept_figures(key)
    if kept is not None:
        fp32, bf16 = kept
    else:
        saved = torch.get_num_threads()
        if threads:
            torch.set_num_threads(threads)
        try:
            fp32 = probe(weight, torch.float32)
            bf16 = probe(weight, torch.bfloat16)
        finally:
            torch.set_num_threads(saved)
        _keep_figures(key, fp32, bf16)
    pick = "bfloat16" if bf16 <= BF16_GAIN * fp32 else None
    on = f"on this CPU, measured at an earlier start ({_cache_path()})" if kept else "on this CPU"
    return GenerationDtype(
        pick,
        f"auto: {pick or 'float32'} (a {PROBE_ROWS}-row product with the {shape} matrix took "
        f"{bf16 * 1e3:.3g} ms in bfloat16 against {fp32 * 1e3:.3g} ms in float32 {on}; "
        f"bfloat16 is taken at <= {BF16_GAIN:.2f}x)",
    )


def _cpu_name() -> str:
    """This CPU's model name from /proc/cpuinfo ('' where there is none: nothing is kept)."""
    try:
        text = Path("/proc/cpuinfo").read_text()
    except OSError:
        return ""
    for line in text.splitlines():
        if line.startswith("model name"):
            return line.split(":", 1)[1].strip()
    return ""


def _probe_key(shape: str, threads: int) -> str:
    cpu = _cpu_name()
    if not cpu:
        return ""
    return f"{cpu} | torch {torch.__version__} | {PROBE_ROWS}x{shape} | {threads} threads"


def _cache_path() -> Path:
    from jetctl.models import cache_dir

    return cache_dir() / PROBE_CACHE


def _kept_figures(key: str) -> tuple[float, float] | None:
    """(float32 s, bfloat16 s) kept for `key`; None: none kept (or the file is unreadable)."""
    if not key:
        return None
    try:
        entry = json.loads(_cache_path().read_text()).get(key)
        return float(entry["float32_s"]), float(entry["bfloat16_s"])
    except (OSError, ValueError, TypeError, KeyError, AttributeError):
        return None


def _keep_figures(key: str, fp32: float, bf16: float) -> None:
    if not key:
        return
    from jetctl.rundir import write_json_atomic

    path = _cache_path()
    try:
        kept = json.loads(path.read_text())
    except (OSError, ValueError):
        kept = {}
    if not isinstance(kept, dict):
        kept = {}
    kept[key] = {"float32_s": fp32, "bfloat16_s": bf16}
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        write_json_atomic(path, kept)
    except OSError:  # a read-only cache: the next start measures again, nothing else is lost
        return
