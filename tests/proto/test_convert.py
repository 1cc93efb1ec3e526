"""`read_weights_chunk` reads a WeightsChunk's wire bytes exactly as protobuf would, and
`weight_frames` writes them exactly as protobuf would."""

from __future__ import annotations

import os

import pytest

from jetctl.proto._gen import swarm_pb2 as pb
from jetctl.proto.convert import read_weights_chunk, weight_frames
from jetctl.server.weights import WeightsPayload

pytestmark = pytest.mark.unit


def _fields(raw: bytes) -> tuple[object, ...]:
    c = read_weights_chunk(raw)
    return (c.version, c.format, c.kind, c.total_bytes, c.offset, bytes(c.data), c.sha256,
            c.adapter_config_json)


def _pb_fields(raw: bytes) -> tuple[object, ...]:
    m = pb.WeightsChunk.FromString(raw)
    return (m.version, m.format, m.kind, m.total_bytes, m.offset, m.data, m.sha256,
            m.adapter_config_json)


@pytest.mark.parametrize("chunk", [
    pb.WeightsChunk(version=7, format="safetensors", kind="lora", total_bytes=1 << 40,
                    offset=1 << 33, data=os.urandom(70_000), sha256="ab" * 32,
                    adapter_config_json='{"r": 16, "note": "ü"}'),
    pb.WeightsChunk(version=-1, data=b""),  # a negative int64 takes ten bytes
    pb.WeightsChunk(),
])
def test_reads_what_protobuf_reads(chunk: pb.WeightsChunk) -> None:
    raw = chunk.SerializeToString()
    assert _fields(raw) == _pb_fields(raw)


def test_last_occurrence_wins_and_unknown_fields_are_skipped() -> None:
    first = pb.WeightsChunk(version=1, kind="full", data=b"old").SerializeToString()
    second = pb.WeightsChunk(version=2, data=b"new").SerializeToString()
    # unknown fields 20 (varint), 21 (fixed64), 22 (bytes) and 23 (fixed32)
    unknown = b"\xa0\x01\x05" + b"\xa9\x01" + bytes(8) + b"\xb2\x01\x02hi" + b"\xbd\x01" + bytes(4)
    raw = first + unknown + second
    assert _fields(raw) == _pb_fields(raw)
    assert bytes(read_weights_chunk(raw).data) == b"new"


def test_data_is_a_view_of_the_frame_not_a_copy() -> None:
    raw = pb.WeightsChunk(version=3, data=b"x" * 1000).SerializeToString()
    assert read_weights_chunk(raw).data.obj is raw


@pytest.mark.parametrize("raw", [
    b"\x32\x10short",  # data says 16 bytes, 5 follow
    b"\x08\xff\xff",  # truncated varint
    b"\x0b",  # wire type 3 (a deprecated group)
])
def test_bytes_that_are_not_a_chunk_are_refused(raw: bytes) -> None:
    with pytest.raises(ValueError):
        read_weights_chunk(raw)


def _protobuf_frames(payload: WeightsPayload, chunk_bytes: int) -> list[bytes]:
    """What `weight_frames` replaced: one WeightsChunk message serialized per chunk."""
    total = len(payload.data)
    return [pb.WeightsChunk(
        version=payload.version, format="safetensors", kind=payload.kind, total_bytes=total,
        offset=offset, data=payload.data[offset : offset + chunk_bytes],
        sha256=payload.sha256,
        adapter_config_json=payload.adapter_config_json if offset == 0 else "",
    ).SerializeToString() for offset in range(0, max(total, 1), chunk_bytes)]


@pytest.mark.parametrize("payload, chunk_bytes", [
    (WeightsPayload(7, "full", os.urandom(300_000), "ab" * 32), 70_000),  # a short last one
    (WeightsPayload(2**40, "lora", os.urandom(1000), "cd" * 32, '{"r": 16, "ü": 1}'), 1000),
    (WeightsPayload(0, "", b"", ""), 4096),  # every field at its default: one bare frame
    (WeightsPayload(-1, "full", b"x" * 200, "ef" * 32), 128),  # a negative int64
])
def test_weight_frames_are_byte_for_byte_protobufs_own(
    payload: WeightsPayload, chunk_bytes: int
) -> None:
    frames = weight_frames(payload, chunk_bytes)
    assert frames == _protobuf_frames(payload, chunk_bytes)
    assert b"".join(bytes(read_weights_chunk(f).data) for f in frames) == payload.data
