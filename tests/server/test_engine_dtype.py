"""`generation.dtype` (engines/dtype.py): what the engine generates in, and `auto`'s measured
pick. The pick must follow this host's figures: bfloat16 made the quickstart's decode 1.4x
faster on a CPU with avx512_bf16 and 2.7x slower on an AVX2-only one."""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

import pytest
import torch

from jetctl.recipe import GenerationConfig, ModelConfig
from jetctl.server.engines.dtype import (
    BF16_GAIN,
    PROBE_CACHE,
    _cpu_name,
    pick_generation_dtype,
    probe_matmul,
)
from tests.server.test_engines import serve

pytestmark = [pytest.mark.unit, pytest.mark.timeout(120)]


def _cfg(**overrides: Any) -> ModelConfig:
    return ModelConfig(model="builtin:tiny", **overrides)


def resolve_generation_dtype(
    cfg: ModelConfig, model: Any, threads: int, probe: Any = probe_matmul
) -> Any:
    """What make_engine asks for a recipe's model."""
    return pick_generation_dtype(
        cfg.generation.dtype, model, model_dtype=cfg.dtype, engine=cfg.engine,
        device=cfg.generation.device or cfg.device, threads=threads, probe=probe,
    )


class _Probe:
    """A host whose float32 product takes 10 ms and bfloat16 `ratio` times that."""

    def __init__(self, ratio: float) -> None:
        self.ratio = ratio
        self.asked: list[torch.dtype] = []

    def __call__(self, weight: torch.Tensor, dtype: torch.dtype) -> float:
        self.asked.append(dtype)
        return 0.010 * (self.ratio if dtype == torch.bfloat16 else 1.0)


@pytest.mark.parametrize(
    ("ratio", "picked"), [(0.7, "bfloat16"), (BF16_GAIN, "bfloat16"), (0.9, None), (2.7, None)]
)
def test_auto_takes_bfloat16_only_where_this_host_measures_it_faster(
    ratio: float, picked: str | None
) -> None:
    model = torch.nn.Sequential(torch.nn.Linear(8, 4), torch.nn.Linear(4, 32))
    probe = _Probe(ratio)
    got = resolve_generation_dtype(_cfg(generation=GenerationConfig(dtype="auto")), model, 1, probe)
    assert got.dtype == picked
    assert probe.asked == [torch.float32, torch.bfloat16]
    # the log line names the pick, the matrix it timed (the largest) and both figures
    assert got.why.startswith(f"auto: {picked or 'float32'} ")
    assert "32x4 matrix" in got.why and "against 10 ms in float32" in got.why


def test_what_is_set_by_name_is_used_without_a_probe() -> None:
    def no_probe(weight: torch.Tensor, dtype: torch.dtype) -> float:
        raise AssertionError("only auto measures")

    model = torch.nn.Linear(4, 4)
    cases = [
        (_cfg(), None),  # unset: the model's dtype, on the trainer's model
        (_cfg(generation=GenerationConfig(dtype="bfloat16")), "bfloat16"),
        (_cfg(generation=GenerationConfig(dtype="float32")), None),  # the model's own
        (_cfg(dtype="bfloat16", generation=GenerationConfig(dtype="auto")), None),
        (_cfg(dtype="float16", generation=GenerationConfig(dtype="float32")), "float32"),
    ]
    for cfg, picked in cases:
        assert resolve_generation_dtype(cfg, model, 1, no_probe).dtype == picked, cfg.generation


def test_auto_on_this_cpu_measures_both_and_the_engine_follows_its_pick() -> None:
    s = serve("hf")
    cfg = _cfg(generation=GenerationConfig(dtype="auto"))
    got = resolve_generation_dtype(cfg, s.model, 1)
    found = re.search(r"took ([\d.e+-]+) ms in bfloat16 against ([\d.e+-]+) ms in float32", got.why)
    assert found, got.why
    bf16, fp32 = float(found[1]), float(found[2])
    assert bf16 > 0 and fp32 > 0
    # the figures decide (3 digits in the line, so only a clear margin is checked)
    if bf16 < 0.8 * fp32:
        assert got.dtype == "bfloat16", got.why
    elif bf16 > 0.9 * fp32:
        assert got.dtype is None, got.why


def test_the_probe_times_a_product_of_the_given_matrix() -> None:
    weight = torch.randn(4096, 256)
    assert 0 < probe_matmul(weight, torch.float32) < 1.0
    assert 0 < probe_matmul(weight, torch.bfloat16) < 5.0


def test_the_probe_is_kept_per_cpu_and_a_later_start_reads_it(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    if not _cpu_name():
        pytest.skip("no CPU model name in /proc/cpuinfo here: nothing is kept")
    monkeypatch.setenv("JETCTL_CACHE", str(tmp_path))
    model = torch.nn.Sequential(torch.nn.Linear(8, 4), torch.nn.Linear(4, 32))
    cfg = _cfg(generation=GenerationConfig(dtype="auto"))
    first = resolve_generation_dtype(cfg, model, 1)
    assert "earlier start" not in first.why, "the first start measures"
    path = tmp_path / PROBE_CACHE
    kept = json.loads(path.read_text())
    ((key, _),) = kept.items()
    assert _cpu_name() in key and f"torch {torch.__version__}" in key and "32x4" in key
    # a later start takes the kept figures, not a new measurement: with bfloat16 made
    # clearly faster in the file, it picks bfloat16 and says where the figures came from
    kept[key] = {"float32_s": 0.010, "bfloat16_s": 0.001}
    path.write_text(json.dumps(kept))
    later = resolve_generation_dtype(cfg, model, 1)
    assert later.dtype == "bfloat16" and "measured at an earlier start" in later.why
    assert "took 1 ms in bfloat16 against 10 ms in float32" in later.why
    # other threads are another key: measured again, and kept beside the first
    resolve_generation_dtype(cfg, model, 2)
    assert len(json.loads(path.read_text())) == 2
