"""On-policy check on SmolLM2-135M-Instruct (the quickstart's model, from the PyPI wheel):
at version v the logprobs the engine returns for what it sampled equal the logprobs the
trainer computes for the same tokens, so the importance ratio is 1.

The server's setup exactly: `load_trainable` (LoRA on q, k, v, o; `jetctl_tree` attention),
the engine from `make_engine` generating under the weights lock, the trainer's path
`timeline_sequences -> pack (tree) -> token_logprobs` in the trainer's adapter view. The
adapter is given non-zero weights first (a model some steps in: a fresh adapter adds
nothing). Checked for a single call and for a two-turn conversation merged into one
training sequence.

Tolerance: |ratio - 1| <= 2e-4 per token. Both sides are fp32, but the engine scores a
token from an incremental forward over a KV cache and the trainer from one packed forward,
so sums run in different orders (measured here: |log ratio| up to ~2e-5; FACTS: 1.5e-5).
A changed weight, a wrong position or an off-by-one token moves it by 1e-2 or more.
"""

from __future__ import annotations

import asyncio
import math
import threading
from functools import cache
from typing import Any

import pytest
import torch

from jetctl.recipe import ModelConfig
from jetctl.server import merge
from jetctl.server.adapter import adapter_mode
from jetctl.server.engines import GenRequest, make_engine
from jetctl.server.step import load_trainable, token_logprobs
from jetctl.types import LLMCall, Trajectory

pytestmark = [pytest.mark.integration, pytest.mark.timeout(600)]

RATIO_TOL = 2e-4
VERSION = 7


@cache
def served() -> tuple[Any, Any]:
    """SmolLM2 as the server loads it, with an adapter that changes the policy."""
    cfg = ModelConfig(model="builtin:smollm2-135m-instruct", finetune="lora")
    model, tokenizer = load_trainable(cfg)
    gen = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "lora_B" in name:
                p.copy_(0.02 * torch.randn(p.shape, generator=gen))
    return model, tokenizer


def generate(prompts: list[list[int]], max_tokens: int = 16) -> list[LLMCall]:
    model, tokenizer = served()
    eos = int(tokenizer.eos_token_id)

    async def go() -> list[LLMCall]:
        engine = make_engine(
            ModelConfig(model="builtin:smollm2-135m-instruct"), model, eos_token_ids=[eos],
            pad_token_id=eos, weights_lock=threading.Lock(), version=lambda: VERSION,
        ).engine
        engine.start()
        try:
            results = await asyncio.gather(*(
                engine.generate(GenRequest(p, max_tokens=max_tokens, temperature=1.0, top_p=1.0))
                for p in prompts
            ))
        finally:
            await engine.stop()
        return [LLMCall("policy", p, r.completion_ids, r.completion_logprobs, r.model_version,
                        r.finish_reason) for p, r in zip(prompts, results)]

    return asyncio.run(go())


def chat(tokenizer: Any, text: str) -> list[int]:
    rendered = tokenizer.apply_chat_template([{"role": "user", "content": text}],
                                             add_generation_prompt=True, tokenize=False)
    return list(tokenizer(rendered, add_special_tokens=False)["input_ids"])


def trainer_log_ratios(trajectories: list[Trajectory]) -> tuple[list[float], int]:
    """log(trainer prob / engine prob) of every generated token, in the trainer's view;
    and how many training sequences the trajectories became."""
    model, _ = served()
    sequences = [s for t in trajectories for s in merge.timeline_sequences(t, 1.0, "tree")]
    out: list[float] = []
    with torch.no_grad(), adapter_mode("train"):
        for mb in merge.pack(sequences, "tree", 8192):
            new = token_logprobs(model, mb)
            out += (new - mb.old_logprobs.to(new.dtype)).tolist()  # old: the engine's
    return out, len(sequences)


def test_a_single_call_is_on_policy() -> None:
    _, tokenizer = served()
    calls = generate([chat(tokenizer, "What is 3 + 4? Answer with a number."),
                      chat(tokenizer, "Name a colour.")])
    assert all(c.model_version == VERSION for c in calls)
    trajectories = [Trajectory(id=f"t{i}", group_id="g", task="t", task_id="0", calls=[c])
                    for i, c in enumerate(calls)]
    log_ratios, _ = trainer_log_ratios(trajectories)
    assert len(log_ratios) == sum(len(c.completion_ids) for c in calls)
    worst = max(abs(math.expm1(x)) for x in log_ratios)
    assert worst <= RATIO_TOL, f"importance ratio off by {worst:.2e}"


def test_a_merged_two_turn_conversation_is_on_policy() -> None:
    _, tokenizer = served()
    first_prompt = chat(tokenizer, "What is 3 + 4? Answer with a number.")
    (first,) = generate([first_prompt])
    eos = int(tokenizer.eos_token_id)
    closing = [] if first.completion_ids[-1] == eos else [eos]  # a reply cut at max_tokens
    turn = tokenizer("\n<|im_start|>user\nAnd 5 + 6?<|im_end|>\n<|im_start|>assistant\n",
                     add_special_tokens=False)["input_ids"]
    second_prompt = first_prompt + first.completion_ids + closing + list(turn)
    (second,) = generate([second_prompt])
    conversation = Trajectory(id="t", group_id="g", task="t", task_id="0", calls=[first, second])
    log_ratios, n_sequences = trainer_log_ratios([conversation])
    assert n_sequences == 1, "the second call extends the first: one merged sequence"
    assert len(log_ratios) == len(first.completion_ids) + len(second.completion_ids)
    worst = max(abs(math.expm1(x)) for x in log_ratios)
    assert worst <= RATIO_TOL, f"importance ratio off by {worst:.2e}"


def test_the_check_can_fail() -> None:
    """Another version's weights give other logprobs: the tolerance is far below that."""
    model, tokenizer = served()
    (call,) = generate([chat(tokenizer, "Name a colour.")])
    trajectory = Trajectory(id="t", group_id="g", task="t", task_id="0", calls=[call])
    lora_b = [p for n, p in model.named_parameters() if "lora_B" in n]
    saved = [p.detach().clone() for p in lora_b]
    try:
        with torch.no_grad():
            for p in lora_b:
                p.mul_(1.5)
        log_ratios, _ = trainer_log_ratios([trajectory])
    finally:
        with torch.no_grad():
            for p, s in zip(lora_b, saved):
                p.copy_(s)
    assert max(abs(math.expm1(x)) for x in log_ratios) > 50 * RATIO_TOL
