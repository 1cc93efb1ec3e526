"""A node's link to its run's controller (`Control.Join`, `Control.Sync`), on any host.

Client nodes and servers use it the same way (grpc.aio):

    link = ControlLink("10.0.0.5:7000", token, tls=None)
    reply = await link.join(cpb.JoinRequest(kind="client", task="digits"), stop)
    # ... every second:
    reply = await link.sync(Identity(...), status={...}, journal=journal)
    link.endpoint("policy")      # the server address the controller gave last

`join` retries until the controller answers (a node may start before its controller
listens) and fails at once on a refusal (an unknown task or model, a stopping run). `sync`
returns None when the controller does not answer: the node keeps working on what it knew
(endpoints, refused revisions), and its status and ledger records go with the next sync
that gets through. Ledger records are sent after the last one the controller says it holds,
at most `batch` per call; the ones it holds are pruned from the journal (jetctl.journal).
"""

from __future__ import annotations

import asyncio
import json
import logging
import socket
import time
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

import grpc

from jetctl.auth import bearer
from jetctl.journal import Journal
from jetctl.logs import LogShipper
from jetctl.net import route_address
from jetctl.proto._gen import control_pb2 as cpb
from jetctl.proto._gen import control_pb2_grpc as cgrpc
from jetctl.tls import TlsFiles, aio_channel, channel

log = logging.getLogger(__name__)

CONTROL_ENV = "JETCTL_CONTROL"  # the controller's address, for nodes the controller starts
REFUSALS = (
    grpc.StatusCode.FAILED_PRECONDITION,
    grpc.StatusCode.NOT_FOUND,
    grpc.StatusCode.INVALID_ARGUMENT,
    grpc.StatusCode.UNAUTHENTICATED,
    grpc.StatusCode.PERMISSION_DENIED,
)


class JoinRefused(Exception):
    """The controller answered the join with a refusal the node cannot retry past."""


@dataclass(frozen=True)
class Identity:
    """Who syncs: what the controller knows the node by."""

    name: str
    kind: str  # client | server
    task: str = ""
    model: str = ""
    revision: str = ""


class ControlLink:
    def __init__(
        self, endpoint: str, token: str, *, tls: TlsFiles | None = None,
        call_timeout_s: float = 5.0, batch: int = 500,
    ) -> None:
        self.endpoint_address = endpoint
        self._token = token
        self._timeout = call_timeout_s
        self._batch = batch
        self._channel = aio_channel(
            endpoint, tls,
            options=[
                ("grpc.keepalive_time_ms", 10_000),
                ("grpc.keepalive_timeout_ms", 5_000),
                ("grpc.keepalive_permit_without_calls", 1),
                ("grpc.http2.max_pings_without_data", 0),
                ("grpc.initial_reconnect_backoff_ms", 200),
                ("grpc.max_reconnect_backoff_ms", 2_000),
                ("grpc.max_receive_message_length", 64 << 20),
                ("grpc.max_send_message_length", 64 << 20),
            ],
        )
        self._stub = cgrpc.ControlStub(self._channel)
        self.host = socket.gethostname()
        self.address = route_address(endpoint)  # this host as the controller sees it
        # set after Join when the controller asks for this process's log lines (ship_logs)
        self.log_shipper: LogShipper | None = None
        self.servers: dict[str, str] = {}  # model -> endpoint, as the controller said last
        self.refused: frozenset[str] = frozenset()
        self.drain_message = ""  # set when the controller says drain
        self.reachable = False
        self.last_ok = 0.0  # monotonic time of the last answered sync
        self._held: int | None = None  # journal records the controller holds (None: ask)

    async def close(self) -> None:
        await self._channel.close()

    # ------------------------------------------------------------------ join

    async def join(
        self, request: cpb.JoinRequest, stop: asyncio.Event | None = None,
        timeout_s: float | None = None,
    ) -> cpb.JoinReply:
        """Join, retrying with backoff while the controller does not answer."""
        if not request.host:
            request.host = self.host
        delay, deadline = 0.5, None if timeout_s is None else time.monotonic() + timeout_s
        while True:
            try:
                reply: cpb.JoinReply = await self._stub.Join(
                    request, metadata=bearer(self._token), timeout=self._timeout
                )
            except grpc.aio.AioRpcError as e:
                if e.code() in REFUSALS:
                    raise JoinRefused(f"{e.code().name}: {e.details()}") from None
                if deadline is not None and time.monotonic() + delay > deadline:
                    raise
                log.warning("join %s: controller %s not answering (%s); retrying in %.1fs",
                            request.kind, self.endpoint_address, e.code().name, delay)
                if stop is not None:
                    try:
                        await asyncio.wait_for(stop.wait(), timeout=delay)
                    except asyncio.TimeoutError:
                        pass
                    if stop.is_set():
                        raise JoinRefused("stopped before the controller answered") from None
                else:
                    await asyncio.sleep(delay)
                delay = min(delay * 2, 5.0)
                continue
            self.servers = dict(reply.servers)
            self.refused = frozenset(reply.refused_revisions)
            self.reachable, self.last_ok = True, time.monotonic()
            return reply

    # ------------------------------------------------------------------ sync

    async def sync(
        self, who: Identity, *, status: dict[str, Any], journal: Journal | None = None,
        endpoint: str = "", metrics: str = "", refused: Iterable[str] = (),
        final: bool = False,
    ) -> cpb.SyncReply | None:
        """One sync: status and the next ledger records in, orders out (None: no answer).
        With `final`, every record left is sent (several calls) before the last one says so."""
        while True:
            records = []
            if journal is not None and self._held is not None:
                records = journal.since(self._held, self._batch)
            more = len(records) == self._batch
            lines = self.log_shipper.take() if self.log_shipper is not None else []
            request = cpb.SyncRequest(
                name=who.name, kind=who.kind, task=who.task, model=who.model,
                revision=who.revision, status_json=json.dumps(status),
                journal=journal.id if journal is not None else "",
                records=[
                    cpb.LedgerRecord(seq=r.seq, table=r.table, op=r.op, key=r.key, data=r.data)
                    for r in records
                ],
                endpoint=endpoint, metrics=metrics, refused_revisions=sorted(refused),
                final=final and not more and self._held is not None, host=self.host,
                log_lines=lines,
            )
            try:
                reply: cpb.SyncReply = await self._stub.Sync(
                    request, metadata=bearer(self._token), timeout=self._timeout
                )
            except grpc.aio.AioRpcError as e:
                if self.log_shipper is not None:
                    self.log_shipper.put_back(lines)
                if self.reachable:
                    log.warning("sync with controller %s failed: %s", self.endpoint_address,
                                e.code().name)
                self.reachable = False
                return None
            self.reachable, self.last_ok = True, time.monotonic()
            first = self._held is None
            self._held = int(reply.journal_seq)
            if journal is not None:  # the controller committed these: the node may drop them
                journal.prune(self._held)
            self.servers = dict(reply.servers)
            self.refused = frozenset(reply.refused_revisions)
            if reply.drain:
                self.drain_message = reply.message or "the controller asked this node to drain"
            # more to send now: a backlog (after a partition), or this was the first call,
            # which only asked how far the controller holds this journal
            if (
                journal is not None and (first or more or final)
                and self._held < journal.last_seq()
            ):
                continue
            return reply

    async def rows(self, request: cpb.RowsRequest) -> cpb.RowsReply:
        """One `Control.Rows` call (jetctl.client.rows); a failure raises grpc.aio.AioRpcError."""
        reply: cpb.RowsReply = await self._stub.Rows(
            request, metadata=bearer(self._token), timeout=self._timeout
        )
        return reply

    def endpoint(self, model: str) -> str:
        """The endpoint of `model`'s server the controller gave last ('' when none yet)."""
        return self.servers.get(model, "")


# The CLI's one-shot Control calls (status, swap, down): blocking, a channel per call.


def call_control(
    endpoint: str,
    token: str,
    method: str,
    request: Any,
    timeout_s: float = 5.0,
    tls: TlsFiles | None = None,
) -> Any:
    """One Control RPC with the run token (over TLS when `tls`); raises grpc.RpcError."""
    with channel(endpoint, tls) as ch:
        stub = cgrpc.ControlStub(ch)
        return getattr(stub, method)(request, metadata=bearer(token), timeout=timeout_s)
