"""The local engine loads a pulled safetensors payload as views into the pull's buffer."""

from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import load, save

from jetctl.client.local_engine import safetensors_views
from jetctl.client.transport import WeightsError

pytestmark = pytest.mark.unit


def mixed_state() -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    return {
        "embed.weight": torch.randn(7, 5, generator=g),
        "norm.weight": torch.randn(5, generator=g).to(torch.bfloat16),
        "head.weight": torch.randn(3, 5, generator=g).to(torch.float16),
        "position_ids": torch.arange(11, dtype=torch.int64),
        "mask": torch.tensor([True, False, True]),
        "empty": torch.zeros(0, 4),
    }


def test_views_equal_safetensors_own_load_and_share_the_buffer() -> None:
    raw = save(mixed_state(), metadata={"format": "pt"})
    buffer = memoryview(bytearray(raw))
    views = safetensors_views(buffer)
    expected = load(raw)
    assert views.keys() == expected.keys()
    for name, tensor in expected.items():
        assert views[name].dtype == tensor.dtype and torch.equal(views[name], tensor), name
    base = torch.frombuffer(buffer, dtype=torch.uint8).data_ptr()
    weight = views["embed.weight"]
    assert base <= weight.data_ptr() < base + len(buffer)  # a view, not a copy
    buffer[weight.data_ptr() - base + 3] ^= 0x40  # a byte of its first float, in place
    assert not torch.equal(weight, expected["embed.weight"])


def _with_header(raw: bytes, edit: dict[str, object]) -> memoryview:
    size = int.from_bytes(raw[:8], "little")
    header = json.loads(raw[8 : 8 + size])
    header["embed.weight"].update(edit)
    text = json.dumps(header).encode()
    return memoryview(bytearray(len(text).to_bytes(8, "little") + text + raw[8 + size :]))


@pytest.mark.parametrize(
    "edit, says",
    [
        ({"data_offsets": [0, 10**9]}, "outside"),
        ({"shape": [7, 6]}, "another size"),
        ({"dtype": "F128"}, "is not one of"),
    ],
)
def test_an_entry_that_does_not_fit_its_bytes_is_refused(
    edit: dict[str, object], says: str
) -> None:
    buffer = _with_header(save(mixed_state()), edit)
    with pytest.raises(WeightsError, match=says):
        safetensors_views(buffer)


def test_a_header_longer_than_the_payload_is_refused() -> None:
    raw = bytearray(save(mixed_state()))
    raw[:8] = (len(raw)).to_bytes(8, "little")
    with pytest.raises(WeightsError, match="header of"):
        safetensors_views(memoryview(raw))
