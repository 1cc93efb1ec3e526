"""Submit retries outages with backoff, treats a lost reply's retry (DUPLICATE) as success,
follows a restarted server to its new endpoint, and never retries a refused token; a weights
pull is checked against its sha256."""

from __future__ import annotations

import asyncio
import os
import time
from pathlib import Path
from typing import Any

import grpc
import pytest

from jetctl.client.transport import (
    RetryPolicy,
    SwarmTransport,
    WeightsError,
    _Parsed,
    submit_request_bytes,
)
from jetctl.proto._gen import swarm_pb2 as pb
from jetctl.proto.convert import group_to_pb
from tests.client.client_fakes import TOKEN, FakeSwarm, start_fake_server, weight_chunks
from tests.factories import make_group

pytestmark = [pytest.mark.integration, pytest.mark.timeout(60)]

FAST = RetryPolicy(attempts=5, base_s=0.2, max_s=1.0, total_s=20.0)


async def test_unavailable_is_retried_with_backoff(
    tokenizer: Any, tokenizer_files: dict[str, bytes], tmp_path: Path
) -> None:
    fake = FakeSwarm(tokenizer, tokenizer_files, submit_faults=["unavailable", "unavailable"])
    server, _ = await start_fake_server(fake, tmp_path)
    transport = SwarmTransport("policy", TOKEN, run_dir=tmp_path, retry=FAST)
    group = group_to_pb(make_group())
    reply = await transport.submit([group])
    assert [a.code for a in reply.acks] == [pb.Ack.ACCEPTED]
    assert len(fake.submit_calls) == 3 and transport.reachable
    gaps = [b - a for a, b in zip(fake.submit_times, fake.submit_times[1:])]
    assert all(g > 0.0 for g in gaps) and sum(gaps) < 3.0  # jittered waits, capped at max_s=1
    await transport.close()
    await server.stop(None)


async def test_lost_reply_is_resent_and_comes_back_duplicate(
    tokenizer: Any, tokenizer_files: dict[str, bytes], tmp_path: Path
) -> None:
    fake = FakeSwarm(tokenizer, tokenizer_files, submit_faults=["drop"])
    server, _ = await start_fake_server(fake, tmp_path)
    transport = SwarmTransport("policy", TOKEN, run_dir=tmp_path, retry=FAST)
    group = group_to_pb(make_group())
    reply = await transport.submit([group])
    assert [a.code for a in reply.acks] == [pb.Ack.DUPLICATE]
    assert list(fake.stored) == [group.id]  # stored exactly once
    await transport.close()
    await server.stop(None)


async def test_follows_a_restarted_server_to_its_new_port(
    tokenizer: Any, tokenizer_files: dict[str, bytes], tmp_path: Path
) -> None:
    fake = FakeSwarm(tokenizer, tokenizer_files)
    server, first = await start_fake_server(fake, tmp_path)
    transport = SwarmTransport("policy", TOKEN, run_dir=tmp_path, retry=FAST)
    await transport.register("n", "digits", "r0")
    await server.stop(None)
    server, second = await start_fake_server(fake, tmp_path)  # new port, endpoint file rewritten
    assert first != second
    reply = await transport.submit([group_to_pb(make_group())])
    assert reply.acks[0].code == pb.Ack.ACCEPTED and transport.endpoint == second
    await transport.close()
    await server.stop(None)


async def test_a_submit_under_way_survives_register_replacing_the_channel(
    tokenizer: Any, tokenizer_files: dict[str, bytes], tmp_path: Path
) -> None:
    # register reopens the channel with the server's message cap; closing the old one at
    # once cancelled a node's Submit on it (the groups of an earlier process go out before
    # the node registers), and the bare CancelledError ended the node's sender for good
    fake = FakeSwarm(tokenizer, tokenizer_files, submit_delay_s=1.0)
    server, _ = await start_fake_server(fake, tmp_path)
    transport = SwarmTransport("policy", TOKEN, run_dir=tmp_path, retry=FAST)
    assert transport.max_message_bytes != fake.max_message_bytes  # register changes the cap
    group = group_to_pb(make_group())
    submit = asyncio.create_task(transport.submit([group]))
    while not fake.submit_calls:
        await asyncio.sleep(0.01)
    await transport.register("n", "digits", "r0")
    assert transport.max_message_bytes == fake.max_message_bytes
    reply = await submit
    assert [a.code for a in reply.acks] == [pb.Ack.ACCEPTED]
    assert len(fake.submit_calls) == 1, "answered on the old channel, not resent"
    second = await transport.submit([group_to_pb(make_group())])  # on the new channel
    assert [a.code for a in second.acks] == [pb.Ack.ACCEPTED]
    await transport.close()
    await server.stop(None)


async def test_bad_token_is_not_retried(
    tokenizer: Any, tokenizer_files: dict[str, bytes], tmp_path: Path
) -> None:
    fake = FakeSwarm(tokenizer, tokenizer_files)
    server, endpoint = await start_fake_server(fake)
    transport = SwarmTransport("policy", "wrong", endpoint=endpoint, retry=FAST)
    t0 = time.monotonic()
    with pytest.raises(grpc.aio.AioRpcError) as err:
        await transport.submit([group_to_pb(make_group())])
    assert err.value.code() == grpc.StatusCode.UNAUTHENTICATED and time.monotonic() - t0 < 2.0
    await transport.close()
    await server.stop(None)


async def test_pulled_weights_are_whole_and_a_flipped_byte_is_refused(
    tokenizer: Any, tokenizer_files: dict[str, bytes], tmp_path: Path
) -> None:
    """Each chunk is hashed in a worker thread as it arrives: the digest must still cover
    every byte in order, so a pull comes back intact, and one byte changed in a middle
    chunk (the announced sha256 being the original's) fails the check."""
    data = os.urandom(300_000)
    fake = FakeSwarm(tokenizer, tokenizer_files)
    fake.weights = weight_chunks(1, "full", data, chunk=7_000)  # 43 chunks
    server, _ = await start_fake_server(fake, tmp_path)
    transport = SwarmTransport("policy", TOKEN, run_dir=tmp_path, retry=FAST)
    weights = await transport.pull_weights(have_version=0)
    assert weights is not None and weights.version == 1 and weights.data == data
    middle = fake.weights[len(fake.weights) // 2]
    middle.data = middle.data[:100] + bytes([middle.data[100] ^ 1]) + middle.data[101:]
    with pytest.raises(WeightsError, match="sha256"):
        await transport.pull_weights(have_version=0)
    await transport.close()
    await server.stop(None)


async def test_a_pull_reuses_a_dropped_payload_buffer_and_never_one_still_viewed(
    tokenizer: Any, tokenizer_files: Any, tmp_path: Path
) -> None:
    """A node pulls every version at the same size: the next pull writes into the previous
    payload's buffer once nothing views it (its pages already mapped), and never into one a
    caller still holds, by its Weights or by a tensor made from it."""
    import torch

    from jetctl.client.transport import PAYLOAD_BUFFERS

    PAYLOAD_BUFFERS.clear()
    fake = FakeSwarm(tokenizer, tokenizer_files)
    server, _ = await start_fake_server(fake, tmp_path)
    transport = SwarmTransport("policy", TOKEN, run_dir=tmp_path, retry=FAST)
    payloads = [os.urandom(200_000) for _ in range(4)]

    async def pull(version: int) -> Any:
        fake.weights = weight_chunks(version, "full", payloads[version], chunk=7_000)
        weights = await transport.pull_weights(have_version=version - 1)
        assert weights is not None and weights.data == payloads[version]
        return weights

    first = await pull(0)
    first_buffer = id(first.data.obj)  # ids, not references: a reference is a view
    reused = PAYLOAD_BUFFERS.reused
    view = torch.frombuffer(first.data, dtype=torch.uint8)  # a tensor the local engine could hold
    del first
    second = await pull(1)  # the first buffer is still viewed by `view`
    assert id(second.data.obj) != first_buffer and PAYLOAD_BUFFERS.reused == reused
    assert bytes(view.numpy()) == payloads[0], "a viewed payload was overwritten"
    second_buffer = id(second.data.obj)  # alive: the pool holds it
    del second
    third = await pull(2)  # nothing views the second one now: its buffer is taken again
    assert id(third.data.obj) == second_buffer and PAYLOAD_BUFFERS.reused == reused + 1
    assert bytes(view.numpy()) == payloads[0]
    del third, view
    fourth = await pull(3)
    assert id(fourth.data.obj) == second_buffer and fourth.data == payloads[3]
    await transport.close()
    await server.stop(None)


def test_a_request_built_from_stored_bytes_is_the_message_protobuf_would_write() -> None:
    """Groups sent as the spool stores them: the request's bytes are the ones protobuf
    writes for the same groups (lengths of 1, 2 and 3 varint bytes), and parse back."""
    groups = [group_to_pb(make_group()) for _ in range(3)]
    groups[1].trajectories[0].metadata["pad"] = "x" * 200  # a 2-byte length
    groups[2].trajectories[0].metadata["pad"] = "y" * 20_000  # a 3-byte length
    payloads = [g.SerializeToString() for g in groups]
    expected = pb.SubmitRequest(groups=groups).SerializeToString()
    assert submit_request_bytes(payloads) == expected
    assert submit_request_bytes(groups) == expected
    assert list(pb.SubmitRequest.FromString(submit_request_bytes(payloads)).groups) == groups
    assert submit_request_bytes([]) == b""
    assert list(_Parsed(payloads)) == groups, "what tracing reads of a Submit, when it is on"


async def test_stored_group_bytes_are_submitted_as_they_are(
    tokenizer: Any, tokenizer_files: dict[str, bytes], tmp_path: Path
) -> None:
    fake = FakeSwarm(tokenizer, tokenizer_files)
    server, _ = await start_fake_server(fake, tmp_path)
    transport = SwarmTransport("policy", TOKEN, run_dir=tmp_path, retry=FAST)
    groups = [group_to_pb(make_group()) for _ in range(2)]
    reply = await transport.submit([g.SerializeToString() for g in groups])
    assert [a.code for a in reply.acks] == [pb.Ack.ACCEPTED] * 2
    assert list(fake.stored) == [g.id for g in groups]
    await transport.close()
    await server.stop(None)
