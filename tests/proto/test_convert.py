"""`read_weights_chunk` reads a WeightsChunk's wire bytes exactly as protobuf would."""

from __future__ import annotations

import os

import pytest

from jetctl.proto._gen import swarm_pb2 as pb
from jetctl.proto.convert import read_weights_chunk

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
