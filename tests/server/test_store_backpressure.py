"""A full store writer answers RESOURCE_EXHAUSTED with a retry-after, and a node honours it
(issue 25): a real SwarmService on loopback with a real store whose writer is stalled (its
lock held, as a slow disk holds it), and a real node's spool, transport and delivery. The
node's groups stay spooled, are sent again after the wait (the link is not taken as down),
and every one is stored once the writer moves."""

from __future__ import annotations

import asyncio
import threading
import time
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import grpc
import pytest

from jetctl.client.metrics import ClientMetrics, NodeStats
from jetctl.client.spool import Spool, SpooledGroup
from jetctl.client.transport import Delivery, DeliveryOptions, RetryPolicy, SwarmTransport
from jetctl.proto._gen import swarm_pb2 as pb
from jetctl.proto._gen import swarm_pb2_grpc as pb_grpc
from jetctl.proto.convert import group_to_pb
from jetctl.server.admission import Limits
from jetctl.server.metrics import ServerMetrics
from jetctl.server.service import RETRY_AFTER_KEY, SwarmService
from jetctl.server.store import TrajectoryStore
from tests.factories import make_group

pytestmark = [pytest.mark.integration, pytest.mark.timeout(60)]


async def _serve(service: SwarmService, run_dir: Path) -> grpc.aio.Server:
    server = grpc.aio.server()
    server.add_generic_rpc_handlers((service.handler(),))
    port = server.add_insecure_port("127.0.0.1:0")
    await server.start()
    (run_dir / "servers").mkdir(parents=True, exist_ok=True)
    (run_dir / "servers" / "policy.json").write_text(
        f'{{"model": "policy", "endpoint": "127.0.0.1:{port}", "version": 0}}'
    )
    return server


def _service(store: TrajectoryStore) -> SwarmService:
    trainer: Any = SimpleNamespace(version=0)  # Submit reads only the version
    return SwarmService(
        model_name="policy", model_source="builtin:tiny",
        limits=Limits(model="policy", vocab_size=64, max_context_tokens=256, max_staleness=10),
        max_new_tokens=8, max_message_bytes=4 << 20, engine=None,  # type: ignore[arg-type]
        store=store, trainer=trainer, metrics=ServerMetrics(), tokenizer_files={},
        chat_template="", eos_token_ids=[0],
    )


async def test_a_stalled_writer_refuses_with_a_retry_after_and_the_node_loses_nothing(
    tmp_path: Path,
) -> None:
    store = TrajectoryStore(tmp_path / "store.sqlite")
    store.open(trained_through_step=0)
    service = _service(store)
    service.max_pending_writes = 2
    server = await _serve(service, tmp_path)
    held, release = threading.Event(), threading.Event()

    def stall_writer() -> None:
        with store._db_lock:
            held.set()
            release.wait(30)

    staller = threading.Thread(target=stall_writer)
    staller.start()
    held.wait(5)
    channel = grpc.aio.insecure_channel(server_endpoint(tmp_path))
    first = [group_to_pb(make_group()) for _ in range(2)]
    waiting = asyncio.ensure_future(
        pb_grpc.SwarmStub(channel).Submit(pb.SubmitRequest(groups=first), timeout=30)
    )
    while service._pending_writes < 2:  # the writer holds these two
        await asyncio.sleep(0.01)

    # a raw call past the bound hears RESOURCE_EXHAUSTED and how long to wait
    with pytest.raises(grpc.aio.AioRpcError) as refused:
        await pb_grpc.SwarmStub(channel).Submit(
            pb.SubmitRequest(groups=[group_to_pb(make_group())]), timeout=10
        )
    assert refused.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
    assert dict(refused.value.trailing_metadata() or ())[RETRY_AFTER_KEY] == "100"

    # a node: its groups stay spooled, deferred by the wait, and the link is not down
    spool = Spool(tmp_path / "spool" / "n.sqlite")
    groups = [make_group() for _ in range(3)]
    spool.put_all([SpooledGroup(g.id, group_to_pb(g).SerializeToString(),
                                [t.id for t in g.trajectories], "policy") for g in groups])
    transport = SwarmTransport("policy", "t", run_dir=tmp_path,
                               retry=RetryPolicy(attempts=2, base_s=0.1, max_s=0.2, total_s=2))
    stats = NodeStats()
    delivery = Delivery(spool, transport, stats, ClientMetrics(),
                        options=DeliveryOptions(batch_groups=4))
    assert await delivery._send_once() == 3
    assert stats.busy_refusals == 1 and spool.depth() == 3
    assert delivery._link_down_since is None, "a busy server is reachable"
    due = spool.next_due_at()
    assert due is not None and due - time.time() > 0.05, "deferred by the server's wait"

    release.set()
    staller.join()
    assert [a.code for a in (await waiting).acks] == [pb.Ack.ACCEPTED] * 2
    sender = asyncio.create_task(delivery.run())
    try:
        for _ in range(200):
            if spool.depth() == 0:
                break
            await asyncio.sleep(0.05)
    finally:
        delivery.stop()
        await sender
    assert spool.depth() == 0, "every spooled group was acked after the wait"
    assert store.counts().groups == {"buffered": 5}, "stored once each, none lost"
    assert service.refused_calls == {"store_busy": 2}
    await transport.close()
    await channel.close()
    await server.stop(None)
    store.close()
    spool.close()


def server_endpoint(run_dir: Path) -> str:
    import json

    return str(json.loads((run_dir / "servers" / "policy.json").read_text())["endpoint"])


async def test_a_node_isolates_a_refused_request_one_group_at_a_time_then_batches_again(
    tmp_path: Path,
) -> None:
    store = TrajectoryStore(tmp_path / "store.sqlite")
    store.open(trained_through_step=0)
    server = await _serve(_service(store), tmp_path)
    spool = Spool(tmp_path / "spool" / "n.sqlite")

    def spooled(prompt: tuple[int, ...]) -> SpooledGroup:
        g = make_group(prompt=prompt)
        return SpooledGroup(g.id, group_to_pb(g).SerializeToString(),
                            [t.id for t in g.trajectories], "policy")

    spool.put_all([spooled((1, 2, 999)) for _ in range(2)])  # token 999: outside the vocab
    transport = SwarmTransport("policy", "t", run_dir=tmp_path)
    stats = NodeStats()
    delivery = Delivery(spool, transport, stats, ClientMetrics(),
                        options=DeliveryOptions(batch_groups=4))
    assert await delivery._send_once() == 2  # refused whole: INVALID_ARGUMENT
    assert delivery._batch == 1
    assert await delivery._send_once() == 1 and await delivery._send_once() == 1
    assert stats.acks == {"invalid": 2}
    assert delivery._batch == 4, "both resent alone: the node batches again"
    spool.put_all([spooled((1, 2, 3)) for _ in range(4)])
    assert await delivery._send_once() == 4, "the next Submit carries four groups"
    assert stats.acks == {"invalid": 2, "accepted": 4} and spool.depth() == 0
    await transport.close()
    await server.stop(None)
    store.close()
    spool.close()
