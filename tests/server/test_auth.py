"""The swarm server's token check: the right token passes, anything else is refused, and the
comparison is constant-time (hmac.compare_digest, as the controller's)."""

from __future__ import annotations

import asyncio
import hmac
from collections import namedtuple
from typing import Any

import grpc
import pytest

from jetctl.server import service
from jetctl.server.service import auth_interceptor

pytestmark = pytest.mark.unit

Details = namedtuple("Details", "method invocation_metadata")
ALLOWED = grpc.unary_unary_rpc_method_handler(lambda req, ctx: req)


def handler_for(metadata: tuple[tuple[str, Any], ...], refused: list[str]) -> Any:
    interceptor = auth_interceptor("s3cret", refused.append)

    async def continuation(_details: Any) -> grpc.RpcMethodHandler:
        return ALLOWED

    details = Details("/jetctl.swarm.v1.Swarm/Submit", metadata)
    return asyncio.run(interceptor.intercept_service(continuation, details))


@pytest.mark.parametrize(
    "metadata",
    [
        (),
        (("authorization", "Bearer s3cres"),),  # same length, last character differs
        (("authorization", "Bearer s3cret "),),
        (("authorization", "bearer s3cret"),),
        (("authorization", "Bearer s3crét"),),  # not ASCII: refused, not a crash
        (("x-token", "Bearer s3cret"),),
    ],
)
def test_anything_but_the_token_is_refused(metadata: tuple[tuple[str, Any], ...]) -> None:
    refused: list[str] = []
    assert handler_for(metadata, refused) is not ALLOWED
    assert refused == ["unauthenticated"]


def test_the_token_passes_and_is_compared_in_constant_time(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    compared: list[tuple[bytes, bytes]] = []
    real = hmac.compare_digest

    def spy(a: bytes, b: bytes) -> bool:
        compared.append((a, b))
        return real(a, b)

    monkeypatch.setattr(service.hmac, "compare_digest", spy)
    refused: list[str] = []
    assert handler_for((("authorization", "Bearer s3cret"),), refused) is ALLOWED
    assert handler_for((("authorization", "Bearer wrong!"),), refused) is not ALLOWED
    assert compared == [(b"Bearer s3cret", b"Bearer s3cret"), (b"Bearer wrong!", b"Bearer s3cret")]
    assert refused == ["unauthenticated"]
