"""The trainable weights of a model as bytes: what PullWeights streams and checkpoints keep.

LoRA models publish only their adapter (peft state dict + adapter config); full
fine-tuning publishes the whole state dict. Payloads are safetensors with a sha256.
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass
from typing import Any

import torch
from safetensors.torch import load as st_load
from safetensors.torch import save as st_save


@dataclass(frozen=True)
class WeightsPayload:
    version: int
    kind: str  # full | lora
    data: bytes  # safetensors
    sha256: str
    adapter_config_json: str = ""


def is_lora(model: Any) -> bool:
    return hasattr(model, "peft_config")


def trainable_state(model: Any) -> dict[str, torch.Tensor]:
    """The tensors that training changes (adapter only for LoRA), detached, on the CPU and
    contiguous: the live tensors where they already are so (no copy of hundreds of MB; the
    caller holds the weights lock until they are serialized)."""
    if is_lora(model):
        from peft import get_peft_model_state_dict

        state = get_peft_model_state_dict(model)
    else:
        state = model.state_dict()
        if getattr(model.config, "tie_word_embeddings", False):
            state = {k: v for k, v in state.items() if k != "lm_head.weight"}
    return {k: v.detach().to("cpu").contiguous() for k, v in state.items()}


def load_trainable_state(model: Any, state: dict[str, torch.Tensor]) -> None:
    if is_lora(model):
        from peft import set_peft_model_state_dict

        set_peft_model_state_dict(model, state)
    else:
        missing, unexpected = model.load_state_dict(state, strict=False)
        missing = [k for k in missing if k != "lm_head.weight"]
        if missing or unexpected:
            raise ValueError(f"weights do not fit the model: missing {missing[:5]}, "
                             f"unexpected {unexpected[:5]}")


def snapshot(model: Any, version: int) -> WeightsPayload:
    data = st_save(trainable_state(model), metadata={"version": str(version)})
    config = ""
    if is_lora(model):
        cfg = model.peft_config["default"].to_dict()
        config = json.dumps(cfg, default=lambda o: sorted(o) if isinstance(o, set) else str(o))
    return WeightsPayload(
        version=version,
        kind="lora" if is_lora(model) else "full",
        data=data,
        sha256=hashlib.sha256(data).hexdigest(),
        adapter_config_json=config,
    )


def decode(data: bytes, sha256: str) -> dict[str, torch.Tensor]:
    digest = hashlib.sha256(data).hexdigest()
    if digest != sha256:
        raise ValueError(f"weights sha256 mismatch: got {digest[:12]}, expected {sha256[:12]}")
    return st_load(data)
