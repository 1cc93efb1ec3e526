"""Per-thread LoRA views (jetctl/server/adapter.py): the trainer's dropout and the reference
policy never reach generation running on another thread over the same model."""

from __future__ import annotations

import threading
from typing import Any

import pytest
import torch

from jetctl.recipe import LoraConfig, ModelConfig
from jetctl.server import merge
from jetctl.server.adapter import AdapterInput, adapter_mode
from jetctl.server.step import load_trainable, token_logprobs
from tests.factories import make_group

pytestmark = pytest.mark.unit


def lora_model(dropout: float = 0.0) -> Any:
    model, _ = load_trainable(
        ModelConfig(model="builtin:tiny", finetune="lora", lora=LoraConfig(dropout=dropout)),
        attn_implementation="sdpa",
    )
    with torch.no_grad():  # a trained adapter: lora_B starts at zero, which would hide it all
        for name, p in model.named_parameters():
            if "lora_B" in name:
                p.normal_(0.0, 0.5)
    return model


def microbatch() -> merge.MicroBatch:
    group = make_group(prompt=(11, 12, 13, 14, 15), completion=(16, 17, 18, 19))
    sequences = merge.timeline_sequences(group.trajectories[0], 1.0, "off")
    (mb,) = merge.pack(sequences, "off", 8192)
    return mb


@torch.no_grad()
def logprobs(model: Any, mb: merge.MicroBatch) -> torch.Tensor:
    return token_logprobs(model, mb)


def test_every_lora_layer_gets_the_switch() -> None:
    model = lora_model()
    switches = [m for m in model.modules() if isinstance(m, AdapterInput)]
    # builtin:tiny: 2 layers x (q, k, v, o)
    assert len(switches) == 8


def test_the_reference_view_is_the_base_model_exactly() -> None:
    model, mb = lora_model(), microbatch()
    with model.disable_adapter():
        base = logprobs(model, mb)
    with adapter_mode("reference"):
        reference = logprobs(model, mb)
    served = logprobs(model, mb)
    assert torch.equal(reference, base)
    assert (served - base).abs().max() > 1e-3, "the adapter changes the policy"


def test_dropout_applies_only_in_the_trainer_view() -> None:
    model, mb = lora_model(dropout=0.5), microbatch()
    served = [logprobs(model, mb) for _ in range(2)]
    assert torch.equal(served[0], served[1]), "generation's view is deterministic"
    with adapter_mode("train"):
        trained = [logprobs(model, mb) for _ in range(2)]
    assert not torch.equal(trained[0], trained[1]), "the trainer's view drops adapter inputs"
    assert not torch.equal(trained[0], served[0])


def test_without_dropout_the_trainer_sees_what_generation_sees() -> None:
    model, mb = lora_model(dropout=0.0), microbatch()
    with adapter_mode("train"):
        trained = logprobs(model, mb)
    assert torch.equal(trained, logprobs(model, mb))


def test_a_view_is_per_thread() -> None:
    """While the trainer's thread is inside the reference view, another thread that runs
    the model (the engine) still sees the adapter."""
    model, mb = lora_model(), microbatch()
    served = logprobs(model, mb)
    inside, done = threading.Event(), threading.Event()
    seen: list[torch.Tensor] = []

    def trainer() -> None:
        with adapter_mode("reference"):
            inside.set()
            done.wait(30)
            seen.append(logprobs(model, mb))

    thread = threading.Thread(target=trainer)
    thread.start()
    assert inside.wait(30)
    other = logprobs(model, mb)  # runs while the trainer thread holds the reference view
    done.set()
    thread.join(30)
    assert torch.equal(other, served)
    with model.disable_adapter():
        assert torch.equal(seen[0], logprobs(model, mb))
