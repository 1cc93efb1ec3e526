"""The controller's calls to a swarm server: gRPC health and `Status`, on one cached channel.

    probe = ServerProbe("10.0.0.5:7100", token, tls=tls)
    probe.healthy()     # health says SERVING (no token needed)
    probe.status()      # the Status reply as a JSON-ready dict, or None
"""

from __future__ import annotations

from typing import Any

import grpc
from google.protobuf.json_format import MessageToDict
from grpc_health.v1 import health_pb2, health_pb2_grpc

from jetctl import auth
from jetctl.proto._gen import swarm_pb2 as spb
from jetctl.proto._gen import swarm_pb2_grpc as sgrpc
from jetctl.tls import TlsFiles, channel

# The probe's channel exists before its server listens (the server loads its model first,
# up to a minute), so its first connects fail; gRPC's default reconnect backoff (1 s, x1.6,
# up to 120 s) had then grown to several seconds, and the controller saw a server as up
# ~8 s after it logged "serving". Short, capped backoff: a server is seen within ~0.5 s.
PROBE_CHANNEL_OPTIONS = [
    ("grpc.initial_reconnect_backoff_ms", 100),
    ("grpc.min_reconnect_backoff_ms", 100),
    ("grpc.max_reconnect_backoff_ms", 500),
]


class ServerProbe:
    """Health and `Status` calls to one swarm server, on one cached channel."""

    def __init__(
        self, endpoint: str, token: str, timeout_s: float = 1.0, tls: TlsFiles | None = None
    ) -> None:
        self.endpoint = endpoint
        self._token = token
        self._timeout_s = timeout_s
        self._channel = channel(endpoint, tls, options=PROBE_CHANNEL_OPTIONS)

    def healthy(self) -> bool:
        """gRPC health says SERVING (health needs no token)."""
        stub = health_pb2_grpc.HealthStub(self._channel)
        try:
            reply = stub.Check(health_pb2.HealthCheckRequest(service=""), timeout=self._timeout_s)
        except grpc.RpcError:
            return False
        return bool(reply.status == health_pb2.HealthCheckResponse.SERVING)

    def status(self) -> dict[str, Any] | None:
        """The server's `Status` reply as a JSON-ready dict, or None when it does not answer."""
        stub = sgrpc.SwarmStub(self._channel)
        try:
            reply = stub.Status(
                spb.StatusRequest(), metadata=auth.bearer(self._token), timeout=self._timeout_s
            )
        except grpc.RpcError:
            return None
        return status_to_dict(reply)

    def close(self) -> None:
        self._channel.close()


def status_to_dict(reply: spb.StatusReply) -> dict[str, Any]:
    """MessageToDict, every field present, proto field names (int64 stays a JSON string)."""
    data: dict[str, Any] = MessageToDict(
        reply, preserving_proto_field_name=True, always_print_fields_with_no_presence=True
    )
    return data
