"""The GPU check's measurements, one table: `python -m jetctl.bench.gpu` (scripts/gpu_check.sh).

For each model configuration, randomly initialised (speed needs no trained weights):
`smollm2-135m` (SmolLM2-135M's shape) and `1.5b` (Qwen2.5-1.5B's shape as a Llama), bf16:

1. generation tokens/s through the server's engines, HF `generate` (engines/hf.py) vs
   continuous batching (engines/continuous.py), at 1, 16 and 64 concurrent requests
   (128-token prompts, 128 new tokens at temperature 1: the path GRPO rollouts take);
2. a GRPO training step (LoRA r=16 on q,k,v,o; one group of G=8 completions of one
   prompt) naive (one sequence per completion) vs tree-packed through `jetctl_tree`:
   seconds and peak memory of the server's own step (`jetctl.server.step.train_step`:
   pack -> token_logprobs -> GRPO loss -> backward -> clipping; no optimizer step);
3. weight publish latency to an engine replica (engines/replica.py): full weights and a
   LoRA adapter, on the same GPU and, when there are two, to the second;
4. `jetctl_tree` vs `sdpa` on one 16k-token tree row (a 2k prompt and 14 branches of 1k):
   forward+backward seconds, peak memory, and the largest logprob difference.

Targets (issue 11, one H200): continuous >= 5x HF at 64 requests; LoRA publish <= 50 ms;
full publish <= 1 s. The table marks each PASS or MISS.

`--smoke` runs the same code on a tiny configuration and small sizes (a CPU dry run: it
checks the driver, not speed). Imports only torch, transformers, peft, safetensors and
pydantic (the step takes the recipe's TrainConfig) besides jetctl's own engine, step and
kernel modules (no grpc or typer).

Left out: vLLM (not on the GPU image), tensor parallelism, end-to-end rollouts (the
quickstart-size run in scripts/gpu_check.sh covers the whole server).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import sys
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import torch

CONFIGS: dict[str, dict[str, Any]] = {  # LlamaConfig keyword arguments
    "tiny": {
        "vocab_size": 2048, "hidden_size": 64, "intermediate_size": 128,
        "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2,
        "max_position_embeddings": 4096, "tie_word_embeddings": True,
    },
    "smollm2-135m": {
        "vocab_size": 49152, "hidden_size": 576, "intermediate_size": 1536,
        "num_hidden_layers": 30, "num_attention_heads": 9, "num_key_value_heads": 3,
        "max_position_embeddings": 20480, "rope_theta": 100000.0, "tie_word_embeddings": True,
    },
    "1.5b": {
        "vocab_size": 151936, "hidden_size": 1536, "intermediate_size": 8960,
        "num_hidden_layers": 28, "num_attention_heads": 12, "num_key_value_heads": 2,
        "max_position_embeddings": 32768, "rope_theta": 1000000.0, "tie_word_embeddings": True,
    },
}
LORA_TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj"]


@dataclass(frozen=True)
class Sizes:
    concurrency: tuple[int, ...] = (1, 16, 64)
    prompt_tokens: int = 128
    new_tokens: int = 128
    group_prompt: int = 1024  # training step: G completions of one prompt
    group_completion: int = 256
    group_size: int = 8
    tree_prompt: int = 2048  # 16k-token tree: prompt + branches
    tree_branch: int = 1024
    tree_branches: int = 14
    publish_repeats: int = 10
    step_repeats: int = 3


SMOKE = Sizes(
    concurrency=(1, 4), prompt_tokens=16, new_tokens=8, group_prompt=64, group_completion=16,
    group_size=4, tree_prompt=64, tree_branch=32, tree_branches=6, publish_repeats=3,
    step_repeats=1,
)


@dataclass
class Report:
    device: str
    model: str
    params_m: float
    rows: list[dict[str, Any]] = field(default_factory=list)

    def add(self, what: str, value: float, unit: str, **extra: Any) -> None:
        row = {"model": self.model, "what": what, "value": value, "unit": unit, **extra}
        self.rows.append(row)
        print(json.dumps(row), flush=True)


# ----------------------------------------------------------------------------- models


def random_model(name: str, device: str, dtype: torch.dtype, attn: str = "jetctl_tree") -> Any:
    """A randomly initialised Llama of configuration `name`, built directly on `device`."""
    from transformers import LlamaConfig, LlamaForCausalLM

    from jetctl.kernels.tree_attention import register

    register()
    torch.manual_seed(0)
    config = LlamaConfig(**CONFIGS[name])
    with torch.device(device):
        model = LlamaForCausalLM._from_config(config, attn_implementation=attn, dtype=dtype)
    return model.eval()


def with_lora(model: Any) -> Any:
    from peft import LoraConfig, get_peft_model

    return get_peft_model(
        model, LoraConfig(r=16, lora_alpha=32, target_modules=LORA_TARGETS, task_type="CAUSAL_LM")
    )


def sync(device: str) -> None:
    if device.startswith("cuda"):
        torch.cuda.synchronize()


@contextmanager
def peak_memory(device: str) -> Iterator[list[float]]:
    """Yields a list that holds, after the block, the peak GiB the block's tensors took."""
    from jetctl.server.memory import memory_figures, reset_peak

    out: list[float] = []
    dev = torch.device(device)
    sync(device)
    reset_peak(dev)
    yield out
    sync(device)
    figures = memory_figures(dev)
    out.append(figures.get("memory/peak_allocated_gib", figures.get("memory/rss_gib", 0.0)))


# ----------------------------------------------------------------------------- generation


def bench_generation(report: Report, model: Any, device: str, sizes: Sizes) -> dict[str, float]:
    """tokens/s of each engine at each concurrency; returns {f"{engine}@{n}": tok/s}."""
    from jetctl.server.engines.continuous import ContinuousEngine
    from jetctl.server.engines.hf import HFEngine
    from jetctl.server.engines.replica import Replica

    for p in model.parameters():
        p.requires_grad_(True)  # what a replica copies (a full fine-tune's weights)
    vocab = model.config.vocab_size
    eos = [vocab - 1]  # a random model rarely samples it: lengths stay near new_tokens
    top = max(sizes.concurrency)
    results: dict[str, float] = {}

    def make(kind: str) -> Any:
        if kind == "hf":
            return HFEngine(
                model, eos_token_ids=eos, pad_token_id=0, weights_lock=threading.Lock(),
                version=lambda: 0, max_batch_size=top, batch_wait_ms=5.0,
            )
        replica = Replica(model, device=device, version=0, timeout_s=30.0)
        return ContinuousEngine(
            replica, eos_token_ids=eos, pad_token_id=0, max_batch_size=top,
            max_new_tokens=sizes.new_tokens, batch_wait_ms=5.0,
        )

    async def run(kind: str) -> None:
        from jetctl.server.engines.base import GenRequest

        engine = make(kind)
        engine.start()
        gen = torch.Generator().manual_seed(1)

        def requests(n: int, new: int) -> list[GenRequest]:
            return [
                GenRequest(torch.randint(0, vocab - 1, (sizes.prompt_tokens,), generator=gen)
                           .tolist(), max_tokens=new, temperature=1.0, top_p=1.0)
                for _ in range(n)
            ]

        try:
            await asyncio.gather(*(engine.generate(r) for r in requests(min(top, 4), 4)))  # warm
            for n in sizes.concurrency:
                batch = requests(n, sizes.new_tokens)
                sync(device)
                t0 = time.perf_counter()
                out = await asyncio.gather(*(engine.generate(r) for r in batch))
                sync(device)
                seconds = time.perf_counter() - t0
                tokens = sum(len(o.completion_ids) for o in out)
                results[f"{kind}@{n}"] = tokens / seconds
                report.add(f"generate tokens/s {kind} x{n}", tokens / seconds, "tok/s",
                           tokens=tokens, seconds=round(seconds, 3))
        finally:
            await engine.stop()

    for kind in ("hf", "continuous"):
        asyncio.run(run(kind))
    n = top
    if f"hf@{n}" in results and f"continuous@{n}" in results:
        speedup = results[f"continuous@{n}"] / results[f"hf@{n}"]
        report.add(f"continuous / hf at x{n}", speedup, "x", target=">= 5", ok=speedup >= 5.0)
    return results


# ----------------------------------------------------------------------------- training


def grpo_group(vocab: int, prompt: int, completion: int, g: int, seed: int) -> list[Any]:
    """G trajectories answering one prompt: what a GRPO group sends the trainer."""
    from jetctl.types import LLMCall, Trajectory

    gen = torch.Generator().manual_seed(seed)
    prompt_ids = torch.randint(0, vocab, (prompt,), generator=gen).tolist()
    out = []
    for i in range(g):
        ids = torch.randint(0, vocab, (completion,), generator=gen).tolist()
        lps = (-torch.rand(completion, generator=gen) * 5).tolist()
        call = LLMCall("m", prompt_ids, ids, lps, model_version=0)
        out.append(Trajectory(id=f"t{i}", group_id="g", task="bench", task_id="0", calls=[call],
                              reward=float(i % 2)))
    return out


def train_step(model: Any, trajectories: list[Any], mode: str, budget: int) -> int:
    """The server's step (`jetctl.server.step.train_step`, GRPO at the recipe's defaults)
    over one group in `mode`, the optimizer left out; returns tokens fed."""
    from jetctl.recipe import OptimizerConfig, TrainConfig
    from jetctl.server import algorithms
    from jetctl.server.step import train_step as server_step

    train = TrainConfig(merge=mode, max_tokens_per_microbatch=budget)  # type: ignore[arg-type]
    result = server_step(model, [trajectories], train, algorithms.make(train),
                         max_grad_norm=OptimizerConfig().max_grad_norm)
    model.zero_grad(set_to_none=True)
    return result.tokens_fed


def bench_train(report: Report, model: Any, device: str, sizes: Sizes) -> None:
    lora = with_lora(model)
    group = grpo_group(model.config.vocab_size, sizes.group_prompt, sizes.group_completion,
                       sizes.group_size, seed=2)
    budget = sizes.group_size * (sizes.group_prompt + sizes.group_completion)
    for mode in ("off", "tree"):
        train_step(lora, group, mode, budget)  # warm
        times, peaks = [], []
        for _ in range(sizes.step_repeats):
            with peak_memory(device) as peak:
                t0 = time.perf_counter()
                tokens = train_step(lora, group, mode, budget)
                sync(device)
                times.append(time.perf_counter() - t0)
            peaks.append(peak[0])
        name = "naive" if mode == "off" else "tree"
        report.add(f"train step {name}", statistics.median(times), "s", tokens=tokens,
                   peak_gib=round(max(peaks), 3))
    lora.unload()  # the base model back, without adapters, for the next benchmarks


# ----------------------------------------------------------------------------- publish


def bench_publish(report: Report, model: Any, device: str, sizes: Sizes) -> None:
    from jetctl.server.engines.replica import Replica

    targets = [device]
    if device.startswith("cuda") and torch.cuda.device_count() > 1:
        targets.append("cuda:1")
    for kind in ("full", "lora"):
        source = with_lora(model) if kind == "lora" else model
        if kind == "full":
            for p in source.parameters():
                p.requires_grad_(True)
        for target in targets:
            replica = Replica(source, device=target, version=0, timeout_s=30.0)
            times = []
            for v in range(1, sizes.publish_repeats + 1):
                times.append(replica.publish(v))
            limit = 0.05 if kind == "lora" else 1.0
            ms = statistics.median(times) * 1000
            report.add(f"publish {kind} -> {target}", ms, "ms",
                       target=f"<= {limit * 1000:g}", ok=ms <= limit * 1000)
            del replica
        if kind == "lora":
            source.unload()
        else:
            for p in model.parameters():
                p.requires_grad_(False)


# ----------------------------------------------------------------------------- kernel


def bench_tree_kernel(report: Report, model: Any, device: str, sizes: Sizes) -> None:
    """One tree row, prompt + branches: jetctl_tree vs sdpa on the same weights."""
    from jetctl.server import merge
    from jetctl.server.step import token_logprobs

    lora = with_lora(model)
    group = grpo_group(model.config.vocab_size, sizes.tree_prompt, sizes.tree_branch,
                       sizes.tree_branches, seed=3)
    sequences = [s for t in group for s in merge.timeline_sequences(t, 1.0, "tree")]
    dtype = next(p for p in model.parameters()).dtype
    budget = sizes.tree_prompt + sizes.tree_branch * sizes.tree_branches
    [mb] = merge.pack(sequences, "tree", budget, dtype=dtype)
    logprobs: dict[str, torch.Tensor] = {}
    base = lora.get_base_model()
    for attn in ("jetctl_tree", "sdpa"):
        base.set_attn_implementation(attn)
        times, peaks = [], []
        for _ in range(1 + sizes.step_repeats):  # the first is a warm-up
            with peak_memory(device) as peak:
                t0 = time.perf_counter()
                lp = token_logprobs(lora, mb)
                lp.sum().backward()
                sync(device)
                times.append(time.perf_counter() - t0)
            peaks.append(peak[0])
            lora.zero_grad(set_to_none=True)
        logprobs[attn] = lp.detach().float()
        report.add(f"tree {mb.num_tokens} tokens {attn} fwd+bwd", statistics.median(times[1:]),
                   "s", peak_gib=round(max(peaks[1:]), 3))
    diff = float((logprobs["jetctl_tree"] - logprobs["sdpa"]).abs().max())
    report.add("tree vs sdpa max |logprob diff|", diff, "nats", dtype=str(dtype))
    base.set_attn_implementation("jetctl_tree")
    lora.unload()


# ----------------------------------------------------------------------------- main


def run_model(name: str, device: str, dtype: torch.dtype, sizes: Sizes,
              parts: set[str]) -> Report:
    model = random_model(name, device, dtype)
    params = sum(p.numel() for p in model.parameters()) / 1e6
    for p in model.parameters():
        p.requires_grad_(False)
    report = Report(device=device, model=name, params_m=round(params, 1))
    print(f"== {name}: {params:.1f}M parameters, {dtype}, {device}", flush=True)
    steps: list[tuple[str, Callable[[Report, Any, str, Sizes], Any]]] = [
        ("generate", bench_generation), ("train", bench_train), ("publish", bench_publish),
        ("tree", bench_tree_kernel),
    ]
    for part, fn in steps:
        if part not in parts:
            continue
        t0 = time.perf_counter()
        try:
            fn(report, model, device, sizes)
        except Exception as exc:  # noqa: BLE001  # a failed part is a row of the table, not a lost run
            report.add(f"{part} FAILED", float("nan"), "", error=f"{type(exc).__name__}: {exc}")
        print(f"   ({part}: {time.perf_counter() - t0:.1f}s)", flush=True)
    del model
    if device.startswith("cuda"):
        torch.cuda.empty_cache()
    return report


def table(reports: list[Report]) -> str:
    lines = [f"{'model':<14} {'measurement':<44} {'value':>12}  unit   note", "-" * 88]
    for r in reports:
        for row in r.rows:
            note = ""
            if "ok" in row:
                note = ("PASS " if row["ok"] else "MISS ") + str(row.get("target", ""))
            elif "peak_gib" in row:
                note = f"peak {row['peak_gib']} GiB"
            elif "error" in row:
                note = row["error"][:60]
            lines.append(f"{r.model:<14} {row['what']:<44} {row['value']:>12.4g}  "
                         f"{row['unit']:<6} {note}")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--dtype", default=None, help="default: bfloat16 on cuda, float32 on cpu")
    ap.add_argument("--models", default="smollm2-135m,1.5b")
    ap.add_argument("--parts", default="generate,train,publish,tree")
    ap.add_argument("--smoke", action="store_true", help="tiny sizes (a CPU dry run)")
    ap.add_argument("--out", type=Path, default=None, help="write the rows as JSON here")
    args = ap.parse_args(argv)
    if args.device.startswith("cuda") and not torch.cuda.is_available():
        print(f"no CUDA device here (torch {torch.__version__}, CUDA build "
              f"{torch.version.cuda}); use --device cpu --smoke for a dry run", file=sys.stderr)
        return 2
    dtype = getattr(torch, args.dtype or ("bfloat16" if args.device.startswith("cuda")
                                          else "float32"))
    sizes = SMOKE if args.smoke else Sizes()
    reports = [run_model(m, args.device, dtype, sizes, set(args.parts.split(",")))
               for m in args.models.split(",")]
    print()
    print(table(reports))
    if args.out:
        args.out.write_text(json.dumps([asdict(r) for r in reports], indent=1))
    failed = any("FAILED" in row["what"] for r in reports for row in r.rows)
    return 1 if failed else 0


if __name__ == "__main__":
    raise SystemExit(main())
