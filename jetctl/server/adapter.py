"""Per-thread views of one LoRA model: the trainer's (with dropout), the reference (no adapter).

The server's engine and trainer share one model object on two threads, and the model stays
in eval mode for the engine's sake. Two things the trainer needs would change what the
engine sees if they were switched on the model as a whole: LoRA dropout (`model.train()`)
and the reference policy of the KL penalty (peft's `disable_adapter()`). Both are switched
per thread instead, by one module that `install` puts where peft keeps each LoRA layer's
dropout, the input of the adapter's path (`result + lora_B(lora_A(dropout(x))) * scaling`):

* `serve` (every thread, by default): the input unchanged, no dropout (the engine's view);
* `train` (inside `adapter_mode("train")`): dropout with the recipe's `lora.dropout`;
* `reference` (inside `adapter_mode("reference")`): zeros, so the adapter adds exactly 0
  and the layer is its base layer: the base model, the policy before any training.

Left out: DoRA and other peft variants (they do not read the dropout module this way), and
full fine-tuning, whose reference would be a second copy of the model (refused in the recipe).
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Iterator
from typing import Any, Literal

import torch
from torch import nn

Mode = Literal["serve", "train", "reference"]

_local = threading.local()


def current_mode() -> Mode:
    mode: Mode = getattr(_local, "mode", "serve")
    return mode


@contextlib.contextmanager
def adapter_mode(mode: Mode) -> Iterator[None]:
    """Run the block with this thread's view of the LoRA layers set to `mode`."""
    before = current_mode()
    _local.mode = mode
    try:
        yield
    finally:
        _local.mode = before


class AdapterInput(nn.Module):
    """What a LoRA layer's adapter sees of its input, by this thread's mode."""

    def __init__(self, p: float) -> None:
        super().__init__()
        self.p = p

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        mode = current_mode()
        if mode == "reference":
            return torch.zeros_like(x)
        if mode == "train" and self.p > 0:
            return nn.functional.dropout(x, self.p, training=True)
        return x

    def extra_repr(self) -> str:
        return f"p={self.p}"


def install(model: Any, dropout: float) -> int:
    """Replace the dropout of every LoRA layer of a peft model; returns how many."""
    replaced = 0
    for module in model.modules():
        slots = getattr(module, "lora_dropout", None)
        if isinstance(slots, nn.ModuleDict):
            for name in list(slots.keys()):
                slots[name] = AdapterInput(dropout)
                replaced += 1
    if not replaced:
        raise ValueError("the model has no LoRA layers to switch (is it a peft LoRA model?)")
    return replaced
