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


@dataclass(frozen=True)
class WeightsPayload:
    version: int
    kind: str  # full | lora
    data: bytes  # safetensors
    sha256: str
    adapter_config_json: str = ""

    @property
    def segments(self) -> list[memoryview]:
        return [memoryview(self.data)]


@dataclass(frozen=True)
class WeightsView:
    """A version's safetensors payload as segments read in place (the length and JSON
    header, then each tensor's bytes), not joined: what `weight_frames` cuts into PullWeights
    messages in one copy. The tensor segments are the live weights: valid only while the
    weights lock is held."""

    version: int
    kind: str  # full | lora
    segments: list[memoryview]
    sha256: str  # of the joined payload
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


# safetensors' dtype names, in the order its serializer lays tensors out (largest first)
SAFETENSORS_ORDER = {
    torch.int64: "I64", torch.float64: "F64", torch.float32: "F32", torch.int32: "I32",
    torch.bfloat16: "BF16", torch.float16: "F16", torch.int16: "I16", torch.int8: "I8",
    torch.uint8: "U8", torch.bool: "BOOL",
}


def serialize(state: dict[str, torch.Tensor], metadata: dict[str, str]) -> bytes:
    """`safetensors.torch.save(state, metadata)`, byte for byte (tests/server/test_weights.py
    compares them), in one copy of the tensors: the header, then every tensor's bytes read
    in place and joined once (safetensors copies each tensor to `bytes`, then all of them
    into its output)."""
    return b"".join(segments(state, metadata))


def segments(state: dict[str, torch.Tensor], metadata: dict[str, str]) -> list[memoryview]:
    """The bytes of `serialize(state, metadata)` as segments, none copied: the header
    length and JSON header, then every tensor's bytes in place. Same layout as safetensors:
    tensors by dtype (the order above) then name, the JSON header padded with spaces to 8
    bytes. One metadata key at most: safetensors writes several in no fixed order."""
    if len(metadata) > 1:
        raise ValueError(f"one metadata key at most, got {sorted(metadata)}")
    rank = list(SAFETENSORS_ORDER)
    for name, t in state.items():
        if t.dtype not in SAFETENSORS_ORDER or t.device.type != "cpu" or not t.is_contiguous():
            raise ValueError(f"{name}: {t.dtype} on {t.device} is not a contiguous CPU tensor "
                             f"of {sorted(SAFETENSORS_ORDER.values())}")
    order = sorted(state, key=lambda name: (rank.index(state[name].dtype), name))
    header: dict[str, Any] = {"__metadata__": metadata} if metadata else {}
    views, offset = [], 0
    for name in order:
        t = state[name]
        size = t.numel() * t.element_size()
        header[name] = {"dtype": SAFETENSORS_ORDER[t.dtype], "shape": list(t.shape),
                        "data_offsets": [offset, offset + size]}
        offset += size
        if size:
            views.append(t.reshape(-1).view(torch.uint8).numpy().data)
    text = json.dumps(header, separators=(",", ":"), ensure_ascii=False).encode()
    text += b" " * (-len(text) % 8)
    return [memoryview(len(text).to_bytes(8, "little") + text), *views]


def view(model: Any, version: int) -> WeightsView:
    """The trainable weights as a `WeightsView` of the live tensors, hashed in place: hold
    the weights lock until its segments are copied out."""
    parts = segments(trainable_state(model), metadata={"version": str(version)})
    digest = hashlib.sha256()
    for part in parts:
        digest.update(part)
    config = ""
    if is_lora(model):
        cfg = model.peft_config["default"].to_dict()
        config = json.dumps(cfg, default=lambda o: sorted(o) if isinstance(o, set) else str(o))
    return WeightsView(version, "lora" if is_lora(model) else "full", parts,
                       digest.hexdigest(), config)


def digest(model: Any) -> str:
    """sha256 of the trainable weights laid out as safetensors without metadata, hashed in
    place: the step log's `replay/weights_sha256` (jetctl/run/replay.py compares it)."""
    h = hashlib.sha256()
    for part in segments(trainable_state(model), metadata={}):
        h.update(part)
    return h.hexdigest()


def snapshot(model: Any, version: int) -> WeightsPayload:
    """The trainable weights as one safetensors payload (a copy: checkpoints, replicas)."""
    v = view(model, version)
    return WeightsPayload(v.version, v.kind, b"".join(v.segments), v.sha256,
                          v.adapter_config_json)


def decode(data: bytes, sha256: str) -> dict[str, torch.Tensor]:
    digest = hashlib.sha256(data).hexdigest()
    if digest != sha256:
        raise ValueError(f"weights sha256 mismatch: got {digest[:12]}, expected {sha256[:12]}")
    return st_load(data)
