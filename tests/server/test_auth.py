"""The swarm server's token check: the right token passes, anything else is refused, and the
comparison is constant-time (hmac.compare_digest, as the controller's)."""

from __future__ import annotations

import asyncio
import hmac
from collections import namedtuple
from typing import Any

import grpc
import pytest

from jetctl import auth
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

    monkeypatch.setattr(auth.hmac, "compare_digest", spy)
    refused: list[str] = []
    assert handler_for((("authorization", "Bearer s3cret"),), refused) is ALLOWED
    assert handler_for((("authorization", "Bearer wrong!"),), refused) is not ALLOWED
    assert compared == [(b"Bearer s3cret", b"Bearer s3cret"), (b"Bearer wrong!", b"Bearer s3cret")]
    assert refused == ["unauthenticated"]


def test_a_node_credential_passes_only_client_calls_of_its_models() -> None:
    """The credential the controller gives a client node: Submit to its model's server, not
    Status (an admin call), nor another model's server, nor once revoked; a forged one is not
    a token at all."""
    cred = auth.node_credential("s3cret", "arith-0", ["policy"])

    def call(method: str, model: str, token: str, revoked: frozenset[str] = frozenset()
             ) -> tuple[bool, list[str]]:
        refused: list[str] = []
        interceptor = auth_interceptor("s3cret", refused.append, model=model,
                                       revoked=lambda node: node in revoked)

        async def continuation(_details: Any) -> grpc.RpcMethodHandler:
            return ALLOWED

        details = Details(f"/jetctl.swarm.v1.Swarm/{method}", (("authorization", f"Bearer {token}"),))
        return asyncio.run(interceptor.intercept_service(continuation, details)) is ALLOWED, refused

    assert call("Submit", "policy", cred) == (True, [])
    assert call("PullWeights", "policy", cred) == (True, [])
    assert call("Status", "policy", cred) == (False, ["permission_denied"])
    assert call("Submit", "critic", cred) == (False, ["permission_denied"])
    forged = auth.node_credential("not-the-run-token", "arith-0", ["policy"])
    assert call("Submit", "policy", forged) == (False, ["unauthenticated"])
    assert call("Status", "policy", "s3cret") == (True, []), "the run token is the admin's"
    gone = frozenset({"arith-0"})  # a swap retired it: the controller said so at a sync
    assert call("Submit", "policy", cred, revoked=gone) == (False, ["revoked"])
