"""Memory figures of a training step, for the step log (`memory/...` keys, GiB).

On CUDA: `memory/peak_allocated_gib` is the most the step's tensors held at once (the peak
counter is reset when the step starts), `memory/allocated_gib` and `memory/reserved_gib`
what torch holds after it (reserved includes the caching allocator's free blocks), and
`memory/device_total_gib` the device's size. On a CPU: the process's resident set now
(`memory/rss_gib`) and its peak since the process started (`memory/peak_rss_gib`; Linux
cannot reset it per step).
"""

from __future__ import annotations

import os
import resource

import torch

GIB = float(1 << 30)


def reset_peak(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)


def memory_figures(device: torch.device) -> dict[str, float]:
    if device.type == "cuda":
        return {
            "memory/peak_allocated_gib": torch.cuda.max_memory_allocated(device) / GIB,
            "memory/allocated_gib": torch.cuda.memory_allocated(device) / GIB,
            "memory/reserved_gib": torch.cuda.memory_reserved(device) / GIB,
            "memory/device_total_gib": torch.cuda.get_device_properties(device).total_memory / GIB,
        }
    rss = _rss_bytes()
    # the kernel updates the high-water mark lazily: never report a peak below the present
    return {"memory/rss_gib": rss / GIB, "memory/peak_rss_gib": max(rss, _peak_rss_bytes()) / GIB}


def _rss_bytes() -> int:
    try:
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    except OSError:  # not Linux: the peak is the best figure there is
        return _peak_rss_bytes()


def _peak_rss_bytes() -> int:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # Linux reports KiB
