"""Map jetctl.types dataclasses to and from swarm.proto messages; slice groups out of bytes.

The server keeps a submitted group as the bytes it arrived in: `group_payloads` cuts each
`TrajectoryGroup` out of a `SubmitRequest`'s wire bytes (no re-serialization), admission
reads their token ids and logprobs as packed bytes (`packed_groups`), and only the trainer
turns them into dataclasses (`group_from_pb`).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Protocol

from google.protobuf.message import DecodeError

from jetctl.proto._gen import packed_pb2
from jetctl.proto._gen import swarm_pb2 as pb
from jetctl.types import LLMCall, Trajectory, TrajectoryGroup


def call_to_pb(c: LLMCall) -> pb.LLMCall:
    return pb.LLMCall(
        model=c.model,
        prompt_ids=c.prompt_ids,
        completion_ids=c.completion_ids,
        completion_logprobs=c.completion_logprobs,
        model_version=c.model_version,
        finish_reason=c.finish_reason,
    )


def call_from_pb(m: pb.LLMCall) -> LLMCall:
    return LLMCall(
        model=m.model,
        prompt_ids=list(m.prompt_ids),
        completion_ids=list(m.completion_ids),
        completion_logprobs=list(m.completion_logprobs),
        model_version=m.model_version,
        finish_reason=m.finish_reason,
    )


def trajectory_to_pb(t: Trajectory) -> pb.Trajectory:
    return pb.Trajectory(
        id=t.id,
        group_id=t.group_id,
        task=t.task,
        task_id=t.task_id,
        client_id=t.client_id,
        client_revision=t.client_revision,
        role=t.role,
        calls=[call_to_pb(c) for c in t.calls],
        reward=t.reward,
        status=t.status,
        error=t.error,
        timings=t.timings,
        metadata=t.metadata,
        costs=t.costs,
    )


def trajectory_from_pb(m: pb.Trajectory) -> Trajectory:
    return Trajectory(
        id=m.id,
        group_id=m.group_id,
        task=m.task,
        task_id=m.task_id,
        client_id=m.client_id,
        client_revision=m.client_revision,
        role=m.role,
        calls=[call_from_pb(c) for c in m.calls],
        reward=m.reward,
        status=m.status,  # type: ignore[arg-type]  # validated by the server's store
        error=m.error,
        timings=dict(m.timings),
        metadata=dict(m.metadata),
        costs=dict(m.costs),
    )


def group_to_pb(g: TrajectoryGroup) -> pb.TrajectoryGroup:
    return pb.TrajectoryGroup(
        id=g.id,
        task=g.task,
        task_id=g.task_id,
        model=g.model,
        trajectories=[trajectory_to_pb(t) for t in g.trajectories],
    )


def group_from_pb(m: pb.TrajectoryGroup) -> TrajectoryGroup:
    return TrajectoryGroup(
        id=m.id,
        task=m.task,
        task_id=m.task_id,
        model=m.model,
        trajectories=[trajectory_from_pb(t) for t in m.trajectories],
    )


def group_from_bytes(payload: bytes) -> TrajectoryGroup:
    """A group from the bytes it was stored in (a serialized `TrajectoryGroup`)."""
    return group_from_pb(pb.TrajectoryGroup.FromString(payload))


SUBMIT_GROUPS_FIELD = 1  # SubmitRequest.groups
# WeightsChunk's field numbers (swarm.proto)
WC_VERSION, WC_FORMAT, WC_KIND, WC_TOTAL_BYTES, WC_OFFSET, WC_DATA, WC_SHA256 = range(1, 8)
WC_ADAPTER_CONFIG = 8


def group_payloads(raw: bytes, request: pb.SubmitRequest) -> list[bytes]:
    """The wire bytes of each group of `request`, which was parsed from `raw`, in order.

    Walks only the top level of the message (one varint pair per field): each occurrence of
    field 1 is one element of the repeated `groups`. Should the walk not match the parsed
    request (a deprecated group-encoded field, say), the groups are serialized again.
    """
    try:
        slices = [data for number, data in length_delimited(raw) if number == SUBMIT_GROUPS_FIELD]
    except ValueError:
        slices = []
    if len(slices) != len(request.groups):
        return [g.SerializeToString() for g in request.groups]
    return slices


def packed_groups(raw: bytes, n_groups: int) -> list[Any]:
    """The `n_groups` groups of a SubmitRequest's wire bytes as `PackedGroup` views
    (packed.proto): each call's token ids and logprobs as the bytes they travel in, for the
    admission checks. None for each where the bytes do not parse that way, or not into
    `n_groups` groups: then admission reads the elements one by one."""
    try:
        views = list(packed_pb2.PackedSubmitRequest.FromString(raw).groups)
    except DecodeError:
        views = []
    return views if len(views) == n_groups else [None] * n_groups


def length_delimited(raw: bytes) -> list[tuple[int, bytes]]:
    """(field number, bytes) of every length-delimited field at the top level of a message,
    in order (packed repeated scalars, strings, embedded messages); other fields are skipped.
    Raises ValueError on bytes that are not a message."""
    return [(number, value) for number, wire, value in _walk(raw) if wire == 2]


def _walk(raw: Any) -> list[tuple[int, int, Any]]:
    """(field number, wire type, value) of every top-level field of a message, in order: an
    int for a varint, a slice of `raw` (bytes or memoryview alike) for a length-delimited
    field, None for a fixed-width one. Raises ValueError on bytes that are not a message."""
    out: list[tuple[int, int, Any]] = []
    i, end = 0, len(raw)
    while i < end:
        key, i = _varint(raw, i)
        number, wire = key >> 3, key & 7
        if wire == 0:
            value, i = _varint(raw, i)
            out.append((number, wire, value))
        elif wire == 1:
            i += 8
            out.append((number, wire, None))
        elif wire == 2:
            length, i = _varint(raw, i)
            out.append((number, wire, raw[i : i + length]))
            i += length
        elif wire == 5:
            i += 4
            out.append((number, wire, None))
        else:
            raise ValueError(f"wire type {wire} at byte {i}")
    if i != end:
        raise ValueError("a field runs past the end of the message")
    return out


def _varint(raw: bytes, i: int) -> tuple[int, int]:
    value = shift = 0
    while True:
        if i >= len(raw) or shift > 63:
            raise ValueError("truncated or overlong varint")
        b = raw[i]
        i += 1
        value |= (b & 0x7F) << shift
        if b < 0x80:
            return value, i
        shift += 7


@dataclass(frozen=True)
class ChunkView:
    """A `WeightsChunk` read from its wire bytes; `data` is a view into them, not a copy."""

    version: int
    format: str
    kind: str
    total_bytes: int
    offset: int
    data: memoryview
    sha256: str
    adapter_config_json: str


def read_weights_chunk(raw: bytes) -> ChunkView:
    """A serialized `WeightsChunk` without the copies of a protobuf parse (the client's
    PullWeights reads hundreds of megabytes: upb copies `data` into its arena and again into
    a `bytes` on access). Follows protobuf's rules: the last occurrence of a field wins and
    unknown fields are skipped. Raises ValueError on bytes that are not such a message."""
    view = memoryview(raw)
    ints = {WC_VERSION: 0, WC_TOTAL_BYTES: 0, WC_OFFSET: 0}
    blobs: dict[int, memoryview] = {}
    for number, wire, value in _walk(view):
        if wire == 0 and number in ints:
            ints[number] = value - (1 << 64) if value >= 1 << 63 else value  # int64
        elif wire == 2:
            blobs[number] = value

    def text(number: int) -> str:
        blob = blobs.get(number)
        return str(blob, "utf-8") if blob is not None else ""

    return ChunkView(
        version=ints[WC_VERSION], format=text(WC_FORMAT), kind=text(WC_KIND),
        total_bytes=ints[WC_TOTAL_BYTES], offset=ints[WC_OFFSET],
        data=blobs.get(WC_DATA, view[0:0]), sha256=text(WC_SHA256),
        adapter_config_json=text(WC_ADAPTER_CONFIG),
    )


class FramedWeights(Protocol):
    """What `weight_frames` reads of a weights payload: the server's `WeightsPayload` (one
    joined buffer) and `WeightsView` (the live tensors' segments) both are one. A protocol,
    so the wire format imports nothing of the server."""

    @property
    def version(self) -> int: ...
    @property
    def kind(self) -> str: ...
    @property
    def segments(self) -> list[memoryview]: ...
    @property
    def sha256(self) -> str: ...
    @property
    def adapter_config_json(self) -> str: ...


def weight_frames(payload: FramedWeights, chunk_bytes: int) -> list[bytes]:
    """A weights payload as serialized PullWeights messages of `chunk_bytes` data each.

    Encoded by hand, byte for byte what `pb.WeightsChunk(...).SerializeToString()` makes
    (fields in number order, proto3 defaults left out; tests/proto/test_convert.py compares
    the two): each frame is one join of its few header bytes and the pieces of the payload's
    segments it covers, where the protobuf path copies the data three times (a slice, the
    message, the serialization). From a `WeightsView` that is the only copy of the live
    tensors: no joined payload is made."""
    parts = [part for part in payload.segments if len(part)]
    total = sum(len(part) for part in parts)
    sha = _string(WC_SHA256, payload.sha256)
    frames = []
    index, at = 0, 0  # the segment and the position in it where the next frame starts
    for offset in range(0, max(total, 1), chunk_bytes):
        pieces: list[memoryview] = []
        need = min(chunk_bytes, total - offset)
        while need:
            part = parts[index]
            piece = part[at : at + need]
            pieces.append(piece)
            need -= len(piece)
            at += len(piece)
            if at == len(part):
                index, at = index + 1, 0
        size = sum(len(piece) for piece in pieces)
        head = b"".join((
            _int(WC_VERSION, payload.version), _string(WC_FORMAT, "safetensors"),
            _string(WC_KIND, payload.kind), _int(WC_TOTAL_BYTES, total),
            _int(WC_OFFSET, offset),
            _key(WC_DATA, 2) + _encode_varint(size) if size else b"",
        ))
        config = payload.adapter_config_json if offset == 0 else ""
        frames.append(b"".join((head, *pieces, sha, _string(WC_ADAPTER_CONFIG, config))))
    return frames


def _key(number: int, wire: int) -> bytes:
    return _encode_varint(number << 3 | wire)


def _int(number: int, value: int) -> bytes:
    """An int64 field (two's complement: a negative value takes ten bytes); 0 is left out."""
    return _key(number, 0) + _encode_varint(value & (1 << 64) - 1) if value else b""


def _string(number: int, value: str) -> bytes:
    raw = value.encode()
    return _key(number, 2) + _encode_varint(len(raw)) + raw if raw else b""


def _encode_varint(value: int) -> bytes:
    out = bytearray()
    while value >= 0x80:
        out.append(value & 0x7F | 0x80)
        value >>= 7
    out.append(value)
    return bytes(out)
