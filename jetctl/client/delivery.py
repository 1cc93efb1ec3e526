"""Delivery: a node's spooled groups pushed to the model's server until each has an ack.

    delivery = Delivery(spool, transport, stats, metrics, on_revision_refused=node.drain)
    sender = asyncio.create_task(delivery.run())   # until delivery.stop()
    delivery.wake()                                # a new group is spooled
    await delivery.flush(grace_s)                  # drain: wait for the spool to empty

A group leaves the spool only on an ack (docs/architecture.md section 6). Due groups go in
batches of at most `batch_groups` and the server's message cap; transport errors defer them
with capped exponential backoff + jitter; while the link is down the oldest group is resent
every `probe_s` and the first ack makes every deferred group due again, so a healed partition
drains in less time than it lasted. A request the server refuses whole (INVALID_ARGUMENT) is
resent one group at a time to find the bad one, and once those are resent the node batches
again. STALE, INVALID and REVISION are final; the REVISION ack means the server refuses this
node's revision, so the node drains. A RESOURCE_EXHAUSTED with a `retry-after-ms` (the
server's store writer is full) defers the batch by that long: the server is reachable, so
this is not a link down, and the groups stay spooled (nothing is lost). A group refused for
good (STALE, INVALID, REVISION), or too large for the server (dead-letter), trained nothing:
its trajectories' costs, read from its spooled bytes, go to the node's waste tally
(jetctl/costs.py `NodeWaste`).

A team task's node has one `Delivery` per model (`model=`), each with its own transport and
taking only its model's groups from the shared spool, so one model's unreachable server
never holds back another's groups.
"""

from __future__ import annotations

import asyncio
import logging
import random
import time
from collections.abc import Callable
from dataclasses import dataclass

import grpc
from google.protobuf.message import DecodeError

from jetctl.client.metrics import ClientMetrics, NodeStats
from jetctl.client.spool import Outcome, PendingGroup, Spool
from jetctl.client.transport import EndpointNotFound, SwarmTransport, retry_after_s
from jetctl.costs import NodeWaste
from jetctl.proto._gen import swarm_pb2 as pb

log = logging.getLogger(__name__)

SILENT_S = 5.0  # a Submit unanswered this long marks the server unreachable in the status

ACK_OUTCOME: dict[int, Outcome] = {
    pb.Ack.ACCEPTED: "accepted",
    pb.Ack.DUPLICATE: "duplicate",
    pb.Ack.STALE: "stale",
    pb.Ack.INVALID: "invalid",
    pb.Ack.REVISION: "revision",
}


@dataclass(frozen=True)
class DeliveryOptions:
    batch_groups: int = 8  # groups per Submit
    resend_base_s: float = 0.5
    resend_max_s: float = 30.0
    probe_s: float = 2.0  # while Submit fails, resend the oldest group this often


class Delivery:
    """The sender side of a node: spool -> Submit -> acks."""

    def __init__(
        self,
        spool: Spool,
        transport: SwarmTransport,
        stats: NodeStats,
        metrics: ClientMetrics,
        *,
        options: DeliveryOptions = DeliveryOptions(),
        on_revision_refused: Callable[[], None] = lambda: None,
        on_acked: Callable[[float, int], None] | None = None,
        model: str | None = None,  # send only this model's groups (None: every group)
        waste: NodeWaste | None = None,  # the node's tally (None: one of its own, in memory)
    ) -> None:
        self.spool = spool
        self.waste = waste if waste is not None else NodeWaste()
        self.model = model
        self.transport = transport
        self.stats = stats
        self.metrics = metrics
        self.opts = options
        self._on_revision_refused = on_revision_refused
        self._on_acked = on_acked  # (seconds the Submit took, groups it acked): benchmarks
        # groups per Submit; drops to 1 after a whole request was refused, to isolate the bad one
        self._batch = options.batch_groups
        self._singles_left = 0  # groups to resend one by one before batching again
        self._wake = asyncio.Event()
        self._stop = asyncio.Event()
        self._link_down_since: float | None = None  # monotonic; a Submit failed in transport
        self._last_probe = 0.0
        self._submit_since: float | None = None  # monotonic start of the Submit under way

    def wake(self) -> None:
        """A group is due (just spooled, or a drain wants the spool flushed)."""
        self._wake.set()

    def stop(self) -> None:
        self._stop.set()

    @property
    def reachable(self) -> bool:
        """The last call got an answer and no Submit has hung for SILENT_S: a blackholed
        connection refuses nothing, and gRPC keepalive may take longer to notice."""
        silent = self._submit_since is not None and (
            time.monotonic() - self._submit_since > SILENT_S
        )
        return self.transport.reachable and not silent

    async def run(self) -> None:
        """Send until `stop()`; cancelling it abandons a Submit still retrying (its groups
        stay spooled)."""
        while not self._stop.is_set():
            try:
                sent = await self._send_once()
                if sent:
                    continue
                if self._probe_due():
                    continue
                next_due = self.spool.next_due_at(self.model)
            except Exception:  # e.g. a spool locked past its timeout
                # a sender that died would leave every later group spooled and unsent while
                # the node looks healthy: say why, and try again in a second
                log.exception("delivery: sending failed; trying again in 1 s")
                self.metrics.delivery_errors.inc()
                next_due = time.time() + 1.0
            wait = 1.0 if next_due is None else min(1.0, max(0.02, next_due - time.time()))
            self._wake.clear()
            try:
                await asyncio.wait_for(self._wake.wait(), timeout=wait)
            except asyncio.TimeoutError:
                pass

    async def flush(self, grace_s: float) -> None:
        """Wait until the spool is empty or `grace_s` is up (un-acked groups stay spooled)."""
        deadline = time.monotonic() + grace_s
        while self.spool.depth(self.model) > 0 and time.monotonic() < deadline:
            self._wake.set()
            await asyncio.sleep(0.05)
        if self.spool.depth(self.model) > 0:
            log.warning(
                "drain: %d groups still un-acked; they stay in %s",
                self.spool.depth(self.model),
                self.spool.path,
            )

    async def _send_once(self) -> int:
        """Push one batch of due groups; returns how many were attempted."""
        due = self.spool.due(limit=self._batch, model=self.model)
        if not due:
            return 0
        limit = self.transport.max_message_bytes
        cap = limit - min(4096, limit // 10)  # room for the request's framing
        batch: list[PendingGroup] = []
        size = 0
        for item in due:
            if len(item.payload) > cap:
                self._dead_letter(item, cap)
                continue
            if batch and size + len(item.payload) > cap:
                break
            batch.append(item)
            size += len(item.payload)
        if not batch:
            return len(due)
        t0 = time.perf_counter()
        try:
            reply = await self._timed_submit([i.payload for i in batch])  # sent as stored
        except (grpc.aio.AioRpcError, EndpointNotFound) as e:
            self._failed(batch, e)
            return len(batch)
        except asyncio.CancelledError:
            task = asyncio.current_task()
            cancelling = getattr(task, "cancelling", None)  # Python 3.11+
            if cancelling is None or cancelling():
                raise  # this sender is being stopped
            # the call was cancelled under the sender (its channel was closed), not the
            # sender: a sender that ended here would leave every later group unsent
            log.warning("submit of %d groups was cancelled under the sender; will resend",
                        len(batch))
            for item in batch:
                self.spool.defer(item.id, self._resend_delay(item.attempts))
            return len(batch)
        if self._on_acked is not None:
            self._on_acked(time.perf_counter() - t0, len(batch))
        if self._link_down_since is not None:
            # the link is back: everything deferred goes now, not after its backoff
            resent = self.spool.retry_now(model=self.model)
            log.info(
                "server reachable again after %.1fs; resending %d deferred groups now",
                time.monotonic() - self._link_down_since, resent,
            )
            self._link_down_since = None
        self._sent_one_by_one()
        acks = {a.group_id: a for a in reply.acks}
        for item in batch:
            ack = acks.get(item.id)
            outcome = ACK_OUTCOME.get(ack.code) if ack is not None else None
            if ack is None or outcome is None:
                self.spool.defer(item.id, self._resend_delay(item.attempts))
                continue
            self._record_ack(item, outcome, ack.reason)
        return len(batch)

    def _failed(self, batch: list[PendingGroup], e: grpc.aio.AioRpcError | EndpointNotFound) -> None:
        """A Submit of `batch` failed: find the bad group of a request refused whole, wait
        as long as a busy server asks, or resend later (the link may be down)."""
        wait_s = retry_after_s(e)
        if isinstance(e, grpc.aio.AioRpcError) and e.code() == grpc.StatusCode.INVALID_ARGUMENT:
            # the server refused the request whole: every group in it is invalid. With
            # several groups, resend them one by one next time to tell which.
            if len(batch) == 1:
                self._record_ack(batch[0], "invalid", f"invalid: {e.details()}")
                self._sent_one_by_one()
            else:
                self._batch = 1
                self._singles_left = len(batch)
                for item in batch:
                    self.spool.defer(item.id, 0.0)
        elif wait_s is not None:  # the server is busy, not gone: wait as long as it asks
            log.info("submit of %d groups: %s; resending in %.1fs", len(batch),
                     short_error(e), wait_s)
            self.stats.busy_refusals += 1
            for item in batch:
                self.spool.defer(item.id, wait_s * random.uniform(1.0, 1.5))
        else:
            log.warning("submit of %d groups failed: %s; will resend", len(batch), short_error(e))
            for item in batch:
                self.spool.defer(item.id, self._resend_delay(item.attempts))
            if self._link_down_since is None:
                self._link_down_since = time.monotonic()

    def _sent_one_by_one(self) -> None:
        """A Submit got its answer: once the groups of a refused request have each been
        resent alone (the bad one found), batch again."""
        if self._singles_left > 0:
            self._singles_left -= 1
            if self._singles_left == 0:
                self._batch = self.opts.batch_groups

    def _dead_letter(self, item: PendingGroup, cap: int) -> None:
        """A group larger than the server takes can never be delivered: give it up, loudly."""
        group = pb.TrajectoryGroup.FromString(item.payload)
        error = f"group is {len(item.payload)} bytes; the server takes at most {cap}"
        delta = self._waste_of(item)
        if self.spool.dead_letter(item.id, [t.id for t in group.trajectories], error,
                                  waste=delta if self._kept_in_spool else None):
            self._waste_recorded(delta)
        self.stats.drop("dead-letter", len(group.trajectories))
        self.metrics.dropped.labels(reason="dead-letter").inc(len(group.trajectories))

    async def _timed_submit(self, groups: list[bytes]) -> pb.SubmitReply:
        """`transport.submit`, noting when it started (the status's liveness check)."""
        self._submit_since = time.monotonic()
        try:
            return await self.transport.submit(groups)
        finally:
            self._submit_since = None

    def _record_ack(self, item: PendingGroup, outcome: Outcome, reason: str) -> None:
        refused = outcome in ("stale", "invalid", "revision")
        # a group refused for good trained nothing: its waste goes to the tally in the ack's
        # own transaction (a node killed after the ack cannot lose it)
        delta = self._waste_of(item) if refused else None
        recorded = self.spool.ack(item.id, outcome, reason,
                                  waste=delta if self._kept_in_spool else None)
        self.stats.acks[outcome] = self.stats.acks.get(outcome, 0) + 1
        if refused:
            log.warning("group %s %s: %s", item.id, outcome, reason)
            if recorded and delta is not None:
                self._waste_recorded(delta)
        if outcome == "revision":
            self._on_revision_refused()  # nothing more to do here

    @property
    def _kept_in_spool(self) -> bool:
        """The node's waste tally lives in this delivery's spool (jetctl/costs.py)."""
        return self.waste.store is self.spool

    def _waste_of(self, item: PendingGroup) -> dict[str, float]:
        """The waste tally of a group that will never train: its trajectories' costs, read
        from its spooled bytes (bytes nobody can read, a damaged spool: counted, costs
        unknown)."""
        try:
            group = pb.TrajectoryGroup.FromString(item.payload)
        except DecodeError:
            return self.waste.tally(({}, None) for _ in range(item.n_trajectories))[0]
        return self.waste.tally(
            (dict(t.costs), t.timings.get("rollout_s")) for t in group.trajectories)[0]

    def _waste_recorded(self, delta: dict[str, float]) -> None:
        """A refused group's tally, once the spool recorded its end: into the node's totals
        (the spool's write held it, unless the tally is kept elsewhere: then added there)."""
        if not self._kept_in_spool and self.waste.store is not None:
            self.waste.store.add_waste(delta)
        self.waste.recorded(delta)

    def _probe_due(self) -> bool:
        """While the link is down, send the oldest deferred group every `probe_s` (a probe):
        the first one that gets through makes everything else due at once."""
        if self._link_down_since is None:
            return False
        now = time.monotonic()
        if now - self._last_probe < self.opts.probe_s:
            return False
        self._last_probe = now
        return self.spool.retry_now(limit=1, model=self.model) > 0

    def _resend_delay(self, attempts: int) -> float:
        cap = min(self.opts.resend_max_s, self.opts.resend_base_s * 2**attempts)
        return random.uniform(cap / 2, cap)


def short_error(e: BaseException) -> str:
    if isinstance(e, grpc.aio.AioRpcError):
        return f"{e.code().name}: {e.details()}"
    return f"{type(e).__name__}: {e}"
