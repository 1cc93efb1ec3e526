"""`weights.serialize` writes what `safetensors.torch.save` writes, in one copy."""

from __future__ import annotations

import hashlib

import pytest
import torch
from safetensors.torch import load, save

from jetctl.proto.convert import read_weights_chunk, weight_frames
from jetctl.server.weights import SAFETENSORS_ORDER, serialize, snapshot, view

pytestmark = pytest.mark.unit


def every_dtype() -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    state = {}
    for i, dtype in enumerate(SAFETENSORS_ORDER):
        values = torch.randn(3, 5, generator=g) * 50
        state[f"layer.{i}.b"] = values.to(dtype)
        state[f"layer.{i}.a"] = values[:2].to(dtype).clone()  # same dtype: ordered by name
    big = torch.randn(4, 6, generator=g)
    state["row"] = big[2]  # contiguous, at an offset into its storage
    state["empty"] = torch.zeros(0, 7)
    state["scalar"] = torch.tensor(1.5, dtype=torch.float64)
    return state


def test_bytes_are_safetensors_own() -> None:
    state = every_dtype()
    metadata = {"version": "12"}
    assert serialize(state, metadata) == save(state, metadata=metadata)
    assert serialize(state, {}) == save(state)


def test_a_snapshot_loads_back_to_the_model_state() -> None:
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(hidden_size=16, intermediate_size=32, num_hidden_layers=1,
                         num_attention_heads=2, num_key_value_heads=2, vocab_size=64,
                         max_position_embeddings=64, tie_word_embeddings=False)
    torch.manual_seed(0)
    model = LlamaForCausalLM(config)
    payload = snapshot(model, version=3)
    assert payload.sha256 == hashlib.sha256(payload.data).hexdigest()
    loaded = load(payload.data)
    state = model.state_dict()
    assert loaded.keys() == state.keys()
    for name, value in state.items():
        assert torch.equal(loaded[name], value), name
    with torch.no_grad():  # the payload is a copy: training on does not reach it
        next(model.parameters()).add_(1.0)
    assert all(torch.equal(load(payload.data)[k], v) for k, v in loaded.items())


@pytest.mark.parametrize("chunk_bytes", [64, 1000, 1 << 20])
def test_frames_cut_from_the_live_tensors_are_the_snapshots_frames(chunk_bytes: int) -> None:
    """PullWeights' frames come straight from the live tensors (`view`: hashed in place, one
    copy): the same bytes and sha256 as cutting the joined snapshot, whether a frame ends
    inside a tensor, spans several, or holds the whole payload."""
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(hidden_size=16, intermediate_size=32, num_hidden_layers=2,
                         num_attention_heads=2, num_key_value_heads=2, vocab_size=64,
                         max_position_embeddings=64)
    torch.manual_seed(0)
    model = LlamaForCausalLM(config)
    live, joined = view(model, version=5), snapshot(model, version=5)
    assert live.sha256 == joined.sha256 == hashlib.sha256(joined.data).hexdigest()
    frames = weight_frames(live, chunk_bytes)
    assert frames == weight_frames(joined, chunk_bytes)
    assert b"".join(bytes(read_weights_chunk(f).data) for f in frames) == joined.data
    with torch.no_grad():  # the frames are a copy: training on does not reach them
        next(model.parameters()).add_(1.0)
    assert frames == weight_frames(joined, chunk_bytes)


def test_what_safetensors_cannot_hold_is_refused() -> None:
    with pytest.raises(ValueError, match="not a contiguous CPU tensor"):
        serialize({"t": torch.zeros(3, 4).t()}, {})
    with pytest.raises(ValueError, match="one metadata key"):
        serialize({}, {"a": "1", "b": "2"})
