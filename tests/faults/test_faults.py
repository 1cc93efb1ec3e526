"""Fault hooks: the spec parser, the faults file that switches faults at run time, and the
drop-ack interceptor on a real gRPC server (commit, then the reply is lost)."""

from __future__ import annotations

import os
import time
from pathlib import Path

import grpc
import pytest

from jetctl.faults import Faults, drop_ack_interceptor, endpoint_override, parse, write_faults_file


@pytest.mark.unit
def test_parse_and_file(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    assert parse("drop_ack:0.3, stall_checkpoint:2") == {"drop_ack": 0.3, "stall_checkpoint": 2.0}
    with pytest.raises(ValueError, match="drop_ack"):
        parse("drop_acks:1")
    path = tmp_path / "faults"
    faults = Faults("drop_ack:0.1", path)
    assert faults.value("drop_ack") == 0.1  # no file: the static value
    write_faults_file(path, {"drop_ack": 1.0})
    os.utime(path, (time.time() + 5, time.time() + 5))
    time.sleep(0.3)
    assert faults.value("drop_ack") == 1.0 and faults.roll("drop_ack")
    monkeypatch.setenv("JETCTL_ENDPOINT_OVERRIDE", "policy=127.0.0.1:9,planner=h:1")
    assert endpoint_override("policy") == "127.0.0.1:9" and endpoint_override("other") is None


@pytest.mark.integration
@pytest.mark.timeout(30)
async def test_drop_ack_commits_then_loses_the_reply() -> None:
    committed: list[bytes] = []

    async def submit(request: bytes, context: grpc.aio.ServicerContext) -> bytes:
        committed.append(request)
        return b"ack"

    server = grpc.aio.server(interceptors=[drop_ack_interceptor(Faults("drop_ack:1"))])
    server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler(
        "t.S", {"Submit": grpc.unary_unary_rpc_method_handler(submit),
                "Other": grpc.unary_unary_rpc_method_handler(submit)}),))
    port = server.add_insecure_port("127.0.0.1:0")
    await server.start()
    async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as ch:
        with pytest.raises(grpc.aio.AioRpcError) as e:
            await ch.unary_unary("/t.S/Submit")(b"g1", timeout=5)
        assert e.value.code() == grpc.StatusCode.UNAVAILABLE
        assert committed == [b"g1"], "the work was done before the reply was dropped"
        assert await ch.unary_unary("/t.S/Other")(b"x", timeout=5) == b"ack"
    await server.stop(None)
