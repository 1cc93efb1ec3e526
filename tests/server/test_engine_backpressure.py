"""A full engine queue answers Generate with RESOURCE_EXHAUSTED and a retry-after, and a node
waits it out (issue 25); the server's gRPC runs at most `limits.max_concurrent_rpcs` calls.

A real SwarmService on a real gRPC server built as `jetctl server` builds it
(`app.grpc_server`), in front of a fake engine whose calls wait for a row and then for the
test to let them finish (a real engine would finish them at its own pace, too fast to fill a
queue on purpose). The node's side is the real transport and the proxy's `ServerBackend`.
"""

from __future__ import annotations

import asyncio
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import grpc
import pytest

from jetctl.client.backend import BackendError, GenerateParams
from jetctl.client.transport import ServerBackend, SwarmTransport
from jetctl.proto._gen import swarm_pb2 as pb
from jetctl.proto._gen import swarm_pb2_grpc as pb_grpc
from jetctl.recipe import LimitsConfig
from jetctl.server.admission import Limits
from jetctl.server.app import grpc_server
from jetctl.server.engines.base import EngineLoad, GenRequest, GenResult
from jetctl.server.metrics import ServerMetrics
from jetctl.server.service import RETRY_AFTER_KEY, SwarmService
from jetctl.server.store import TrajectoryStore
from tests.factories import parsed_recipe

pytestmark = [pytest.mark.integration, pytest.mark.timeout(60)]


class GatedEngine:
    """The engine contract (engines/base.py): `max_rows` calls generate at once, the rest
    wait for a row, and none finishes before `release` is set. A reply echoes the prompt's
    tokens plus one, so a test can tell whose reply it got."""

    def __init__(self, max_rows: int) -> None:
        self.max_rows = max_rows
        self.held = 0  # calls inside generate
        self.release = asyncio.Event()

    @property
    def busy_since(self) -> float | None:
        return None

    def start(self) -> None:
        pass

    async def stop(self) -> None:
        self.release.set()

    def load(self) -> EngineLoad:
        rows = min(self.held, self.max_rows)
        return EngineLoad(rows=rows, max_rows=self.max_rows, queued=self.held - rows)

    async def generate(self, req: GenRequest) -> GenResult:
        self.held += 1
        try:
            await self.release.wait()
        finally:
            self.held -= 1
        ids = [t + 1 for t in req.prompt_ids][: req.max_tokens]
        return GenResult(ids, [-0.5] * len(ids), 0, "length")


def parsed_limits(**limits: int) -> LimitsConfig:
    """models.policy.limits of a recipe that sets `limits`, parsed as `jetctl server` reads
    it; `_serve` hands it to `grpc_server`, as the server does with its recipe's."""
    return parsed_recipe(models={"policy": {"limits": limits}}).models["policy"].limits


async def _serve(
    tmp_path: Path, engine: GatedEngine, limits: LimitsConfig
) -> tuple[grpc.aio.Server, SwarmService, str]:
    store = TrajectoryStore(tmp_path / "store.sqlite")
    store.open(trained_through_step=0)
    trainer: Any = SimpleNamespace(version=0)  # Generate reads nothing else of it
    service = SwarmService(
        model_name="policy", model_source="builtin:tiny",
        limits=Limits(model="policy", vocab_size=64, max_context_tokens=256, max_staleness=10),
        max_new_tokens=8, max_message_bytes=limits.max_message_bytes, engine=engine,
        store=store, trainer=trainer, metrics=ServerMetrics(), tokenizer_files={},
        chat_template="", eos_token_ids=[0],
        max_queued_generates=limits.max_queued_generates,
    )
    server = grpc_server(limits, [])
    server.add_generic_rpc_handlers((service.handler(),))
    port = server.add_insecure_port("127.0.0.1:0")
    await server.start()
    return server, service, f"127.0.0.1:{port}"


def _request(*prompt: int) -> pb.GenerateRequest:
    return pb.GenerateRequest(model="policy", prompt_ids=list(prompt), max_tokens=4)


async def _until(condition: Any, what: str) -> None:
    for _ in range(500):
        if condition():
            return
        await asyncio.sleep(0.01)
    raise AssertionError(f"timed out waiting until {what}")


async def test_past_max_queued_generates_generate_is_refused_with_a_retry_after_and_the_node_waits(
    tmp_path: Path,
) -> None:
    engine = GatedEngine(max_rows=1)
    limits = parsed_limits(max_queued_generates=2)
    server, service, endpoint = await _serve(tmp_path, engine, limits)
    channel = grpc.aio.insecure_channel(endpoint)
    stub = pb_grpc.SwarmStub(channel)
    # one call on the engine's row, two waiting for it: the queue is at its bound
    first = [asyncio.ensure_future(stub.Generate(_request(i), timeout=30)) for i in (1, 2, 3)]
    await _until(lambda: engine.held == 3, "three calls are in the engine")

    with pytest.raises(grpc.aio.AioRpcError) as refused:
        await stub.Generate(_request(9), timeout=10)
    assert refused.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
    assert "limits.max_queued_generates" in (refused.value.details() or "")
    retry_ms = int(dict(refused.value.trailing_metadata() or ())[RETRY_AFTER_KEY])
    assert 100 <= retry_ms <= 5000, retry_ms
    assert engine.held == 3, "the refused call never reached the engine"
    registry = service.metrics.registry
    assert registry.get_sample_value(
        "jetctl_server_calls_refused_total", {"reason": "engine_busy"}
    ) == 1
    assert registry.get_sample_value("jetctl_server_generate_waiting") == 2

    # a node's call: refused, it waits the server's time instead of failing the rollout
    transport = SwarmTransport("policy", "t", endpoint=endpoint)
    backend = ServerBackend(transport)
    params = GenerateParams(prompt_ids=[5, 6], max_tokens=4, temperature=1.0, top_p=1.0,
                            stop_token_ids=[], request_id="r1")
    waiting = asyncio.ensure_future(backend.generate(params))
    await _until(lambda: transport.busy_waits == 1, "the node was refused and waits")
    assert not waiting.done(), "the node waits; its call did not fail"

    engine.release.set()
    assert [list(r.completion_ids) for r in await asyncio.gather(*first)] == [[2], [3], [4]]
    result = await asyncio.wait_for(waiting, timeout=20)
    assert result.completion_ids == [6, 7], "the node's call was made again and answered"
    assert transport.busy_waits == 1
    assert service.refused_calls == {"engine_busy": 2}
    await transport.close()
    await channel.close()
    await server.stop(None)
    service.store.close()


async def test_a_node_whose_wait_outlasts_its_generate_timeout_fails_with_503(
    tmp_path: Path,
) -> None:
    engine = GatedEngine(max_rows=1)
    server, service, endpoint = await _serve(tmp_path, engine, parsed_limits(max_queued_generates=1))
    channel = grpc.aio.insecure_channel(endpoint)
    stub = pb_grpc.SwarmStub(channel)
    held = [asyncio.ensure_future(stub.Generate(_request(i), timeout=30)) for i in (1, 2)]
    await _until(lambda: engine.held == 2, "a row and a waiting call")

    with pytest.raises(grpc.aio.AioRpcError) as refused:
        await stub.Generate(_request(9), timeout=10)
    retry_s = int(dict(refused.value.trailing_metadata() or ())[RETRY_AFTER_KEY]) / 1000
    # a node with less time left than the server asks it to wait gives up at once
    transport = SwarmTransport("policy", "t", endpoint=endpoint, generate_timeout_s=retry_s / 2)
    params = GenerateParams(prompt_ids=[5], max_tokens=4, temperature=1.0, top_p=1.0,
                            stop_token_ids=[], request_id="r2")
    with pytest.raises(BackendError) as failed:
        await ServerBackend(transport).generate(params)
    assert failed.value.status == 503, "a busy server is not the request's fault (not 400)"
    assert "RESOURCE_EXHAUSTED" in str(failed.value)
    assert transport.busy_waits == 0
    engine.release.set()
    await asyncio.gather(*held)
    await transport.close()
    await channel.close()
    await server.stop(None)
    service.store.close()


async def test_past_max_concurrent_rpcs_any_call_is_refused_until_one_finishes(
    tmp_path: Path,
) -> None:
    engine = GatedEngine(max_rows=8)  # rows for every call: Generate's own bound stays quiet
    limits = parsed_limits(max_queued_generates=1, max_concurrent_rpcs=2)
    server, service, endpoint = await _serve(tmp_path, engine, limits)
    channel = grpc.aio.insecure_channel(endpoint)
    stub = pb_grpc.SwarmStub(channel)
    held = [asyncio.ensure_future(stub.Generate(_request(i), timeout=30)) for i in (1, 2)]
    await _until(lambda: engine.held == 2, "two calls run")

    with pytest.raises(grpc.aio.AioRpcError) as refused:
        await stub.Register(pb.RegisterRequest(model="policy"), timeout=10)
    assert refused.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
    assert RETRY_AFTER_KEY not in dict(refused.value.trailing_metadata() or ()), "gRPC's own"
    assert engine.held == 2

    engine.release.set()
    await asyncio.gather(*held)
    # the server frees a call's slot just after its reply has gone: allow it a moment
    reply = None
    for _ in range(20):
        try:
            reply = await stub.Register(pb.RegisterRequest(model="policy"), timeout=10)
            break
        except grpc.aio.AioRpcError as e:
            assert e.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
            await asyncio.sleep(0.05)
    assert reply is not None and reply.model == "policy", "with the calls done it answers"
    await channel.close()
    await server.stop(None)
    service.store.close()


def test_a_concurrency_cap_not_above_the_generate_queue_is_refused_with_the_fix() -> None:
    with pytest.raises(ValueError) as refused:
        LimitsConfig(max_queued_generates=64, max_concurrent_rpcs=64)
    assert "set max_concurrent_rpcs above it, e.g. to 128" in str(refused.value)
