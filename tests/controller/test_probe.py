"""The controller's server probe sees a server soon after it starts listening, however long
the server took to start (loading a model takes up to a minute)."""

from __future__ import annotations

import socket
import time
from concurrent import futures

import grpc
import pytest
from grpc_health.v1 import health, health_pb2, health_pb2_grpc

from jetctl.controller.probe import ServerProbe

pytestmark = [pytest.mark.integration, pytest.mark.timeout(60)]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def test_a_server_that_starts_late_is_seen_within_a_second() -> None:
    endpoint = f"127.0.0.1:{free_port()}"
    probe = ServerProbe(endpoint, token="t", timeout_s=1.0)
    # 12 s of failed probes, as while a server loads its model: gRPC's default reconnect
    # backoff would have grown past 6 s by now
    deadline = time.monotonic() + 12
    while time.monotonic() < deadline:
        assert not probe.healthy()
        time.sleep(0.25)
    server = grpc.server(futures.ThreadPoolExecutor(max_workers=2))
    servicer = health.HealthServicer()
    servicer.set("", health_pb2.HealthCheckResponse.SERVING)
    health_pb2_grpc.add_HealthServicer_to_server(servicer, server)
    server.add_insecure_port(endpoint)
    server.start()
    listening = time.monotonic()
    try:
        while not probe.healthy():
            assert time.monotonic() - listening < 10, "the probe never saw the server"
            time.sleep(0.1)
        seen_after = time.monotonic() - listening
    finally:
        probe.close()
        server.stop(None)
    assert seen_after < 1.5, f"seen {seen_after:.1f}s after the server listened"
