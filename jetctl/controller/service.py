"""gRPC glue of the controller: the `Control` servicer and its token check. The controller's
calls to the swarm servers are probe.py's; the CLI's calls to the controller are
`jetctl.link.call_control`.

The servicer is thin: it hands each request to the `Controller` (and the nodes' `Join` and
`Sync` to its `Hub`, hub.py). `Scale` answers UNIMPLEMENTED for now. It knows the controller
only as `ControlTarget`, the few calls it makes, so this module does not import controller.py
(which imports it to start the service).
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from concurrent import futures
from typing import Any, Protocol

import grpc

from jetctl import auth
from jetctl.controller.hub import Hub, Refusal
from jetctl.controller.rows import Lease, RowsCall, RowsRefused
from jetctl.controller.swap import SwapResult
from jetctl.net import WILDCARDS
from jetctl.proto._gen import control_pb2 as cpb
from jetctl.proto._gen import control_pb2_grpc as cgrpc
from jetctl.tls import TlsFiles, add_port

log = logging.getLogger("jetctl.controller")


class ControlTarget(Protocol):
    """What the Control service asks of the controller (controller.py's `Controller`)."""

    token: str  # the run token; a node credential is checked against it too
    refused_calls: dict[str, int]  # serve_control hands it the interceptor's counts

    @property
    def hub(self) -> Hub: ...

    def revoked(self, node: str) -> bool: ...

    def status(self) -> cpb.RunStatusReply: ...

    def request_stop(self, reason: str, grace_s: float | None = None) -> None: ...

    def swap_clients(
        self, task: str, *, image: str | None = None, agent: str | None = None,
        grace_s: float | None = None, drop_old: bool = False,
    ) -> SwapResult: ...

    def lease_rows(self, call: RowsCall) -> Lease: ...


class TokenInterceptor(grpc.ServerInterceptor):
    """Refuses every call without a valid token of the run (UNAUTHENTICATED): the run token
    may call anything; a node credential (jetctl.auth) only Join and Sync, and not once the
    node is `revoked` (PERMISSION_DENIED). Each refusal is counted in `refused` by reason."""

    def __init__(self, token: str, revoked: Callable[[str], bool] = lambda _node: False) -> None:
        self._token = token
        self._revoked = revoked
        self.refused: dict[str, int] = {}

    def _deny(self, code: grpc.StatusCode, reason: str, message: str) -> grpc.RpcMethodHandler:
        self.refused[reason] = self.refused.get(reason, 0) + 1
        log.warning("refused a control call: %s", message)

        def deny(_request: Any, context: grpc.ServicerContext) -> Any:
            context.abort(code, message)

        return grpc.unary_unary_rpc_method_handler(deny)

    def intercept_service(
        self,
        continuation: Callable[[grpc.HandlerCallDetails], grpc.RpcMethodHandler | None],
        handler_call_details: grpc.HandlerCallDetails,
    ) -> grpc.RpcMethodHandler | None:
        method = handler_call_details.method  # type: ignore[attr-defined]
        metadata = handler_call_details.invocation_metadata  # type: ignore[attr-defined]
        who = auth.metadata_principal(metadata, self._token)
        if who is None:
            return self._deny(grpc.StatusCode.UNAUTHENTICATED, "unauthenticated",
                              "missing or wrong run token")
        if not who.may_call(method):
            return self._deny(grpc.StatusCode.PERMISSION_DENIED, "permission_denied",
                              f"node {who.node}'s credential does not allow {method}")
        if who.node is not None and self._revoked(who.node):
            return self._deny(grpc.StatusCode.PERMISSION_DENIED, "revoked",
                              f"node {who.node}'s credential was revoked (it left the run)")
        return continuation(handler_call_details)


class ControlServicer(cgrpc.ControlServicer):
    def __init__(self, controller: ControlTarget, interceptor: TokenInterceptor) -> None:
        self._c = controller
        self._interceptor = interceptor

    def _own_name_only(self, context: grpc.ServicerContext, name: str) -> None:
        """A node credential joins and syncs as its own node only (counted when not)."""
        who = auth.metadata_principal(context.invocation_metadata(), self._c.token)
        if who is not None and who.node is not None and who.node != name:
            refused = self._interceptor.refused
            refused["permission_denied"] = refused.get("permission_denied", 0) + 1
            log.warning("refused: node %s's credential used to join or sync as %r", who.node, name)
            context.abort(grpc.StatusCode.PERMISSION_DENIED,
                          f"node {who.node}'s credential cannot join or sync as {name!r}")

    def Status(self, request: cpb.RunStatusRequest, context: grpc.ServicerContext) -> cpb.RunStatusReply:
        return self._c.status()

    def Down(self, request: cpb.DownRequest, context: grpc.ServicerContext) -> cpb.DownReply:
        grace = request.grace_s if request.grace_s > 0 else None
        self._c.request_stop("down", grace_s=grace)
        return cpb.DownReply(ok=True, message="draining: clients first, then servers")

    def SwapClients(self, request: cpb.SwapRequest, context: grpc.ServicerContext) -> cpb.SwapReply:
        """Blocks until the swap is done (new nodes healthy, old ones drained) or undone."""
        result = self._c.swap_clients(
            request.task,
            image=request.image or None,
            agent=request.agent or None,
            grace_s=request.grace_s if request.grace_s > 0 else None,
            drop_old=request.drop_old,
        )
        if not result.ok:
            context.set_code(grpc.StatusCode.FAILED_PRECONDITION)
            context.set_details(result.message)
        return cpb.SwapReply(ok=result.ok, message=result.message, revision=result.revision)

    def Join(self, request: cpb.JoinRequest, context: grpc.ServicerContext) -> cpb.JoinReply:
        self._own_name_only(context, request.name)
        try:
            return self._c.hub.join(request)
        except Refusal as e:
            context.abort(getattr(grpc.StatusCode, e.code), e.message)
            raise AssertionError("unreachable: abort raises") from None

    def Sync(self, request: cpb.SyncRequest, context: grpc.ServicerContext) -> cpb.SyncReply:
        self._own_name_only(context, request.name)
        return self._c.hub.sync(request)

    def Rows(self, request: cpb.RowsRequest, context: grpc.ServicerContext) -> cpb.RowsReply:
        """A dataset task's rows: a node leases, acks and releases positions (rows.py)."""
        self._own_name_only(context, request.name)
        call = RowsCall(
            name=request.name, task=request.task, n_rows=request.n_rows,
            epochs=request.epochs or None, want=request.want,
            acked=tuple((p.epoch, p.index) for p in request.acked),
            released=tuple((p.epoch, p.index) for p in request.released), fresh=request.fresh,
        )
        try:
            lease = self._c.lease_rows(call)
        except RowsRefused as e:
            context.abort(grpc.StatusCode.FAILED_PRECONDITION, str(e))
            raise AssertionError("unreachable: abort raises") from None
        return cpb.RowsReply(
            rows=[cpb.RowPosition(epoch=e, index=i) for e, i in lease.positions],
            exhausted=lease.exhausted,
        )

    def Scale(self, request: cpb.ScaleRequest, context: grpc.ServicerContext) -> cpb.ScaleReply:
        msg = (
            "scale is not implemented by this controller yet: edit tasks.<task>.clients "
            "and `jetctl up --resume`"
        )
        context.set_code(grpc.StatusCode.UNIMPLEMENTED)
        context.set_details(msg)
        return cpb.ScaleReply(ok=False, message=msg)


def serve_control(
    controller: ControlTarget, token: str, host: str = "127.0.0.1", tls: TlsFiles | None = None,
    port: int = 0, also: list[str] | None = None,
) -> tuple[grpc.Server, int]:
    """Start the Control service on `host:port` (0: a free port; TLS when the run uses it),
    and on the same port of each address in `also` (the run's docker network gateway);
    returns (server, port), port 0 when it could not bind."""
    interceptor = TokenInterceptor(token, revoked=controller.revoked)
    controller.refused_calls = interceptor.refused
    server = grpc.server(
        futures.ThreadPoolExecutor(max_workers=8, thread_name_prefix="control"),
        interceptors=[interceptor],
        options=[
            ("grpc.max_receive_message_length", 64 << 20),
            ("grpc.max_send_message_length", 64 << 20),
            # nodes ping every 10 s, also between syncs
            ("grpc.http2.min_recv_ping_interval_without_data_ms", 5_000),
            ("grpc.keepalive_permit_without_calls", 1),
            ("grpc.http2.max_ping_strikes", 0),
        ],
    )
    cgrpc.add_ControlServicer_to_server(ControlServicer(controller, interceptor), server)
    try:
        bound = add_port(server, f"{host}:{port}", tls)
        for extra in listen_also_hosts(host, also or []):
            if bound and not add_port(server, f"{extra}:{bound}", tls):
                bound = 0
    except RuntimeError:  # grpc raises when the address is taken
        bound = 0
    if bound:
        server.start()
    return server, bound


def listen_also_hosts(host: str, also: list[str]) -> list[str]:
    """`also`, less `host` itself, and none when `host` is a wildcard bind already."""
    return [] if host in WILDCARDS else [a for a in also if a != host]
