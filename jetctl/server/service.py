"""The Swarm gRPC service: thin handlers, proto in -> logic -> proto out.

Handlers receive raw request bytes and parse them here, so a garbage payload is refused
with INVALID_ARGUMENT (and counted) instead of an opaque deserialization failure. The
bearer token is checked by an interceptor (auth.py); message sizes are capped by the
server options (RESOURCE_EXHAUSTED before anything is buffered whole).
"""

from __future__ import annotations

import asyncio
import logging
import os
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any, cast

import grpc
from google.protobuf.message import DecodeError

from jetctl import tracing
from jetctl.auth import metadata_principal
from jetctl.proto._gen import swarm_pb2 as pb
from jetctl.proto.convert import group_payloads, packed_groups
from jetctl.server.admission import Limits, check_generate, check_groups
from jetctl.server.engines.base import Engine, GenRequest
from jetctl.server.figures import RecentRate
from jetctl.server.metrics import ServerMetrics
from jetctl.server.store import Put, TrajectoryStore
from jetctl.server.trainer import Trainer

SERVICE = "jetctl.swarm.v1.Swarm"
log = logging.getLogger("jetctl.server")
CHUNK_BYTES = 4 << 20  # PullWeights data per message (less when max_message_bytes is smaller)
CHUNK_FRAMING = 4096  # room in a message for a chunk's other fields
MAX_TASK_LABELS = 64  # distinct `task` label values; more would grow /metrics without bound
# groups handed to the store's writer and not yet committed; past it Submit answers
# RESOURCE_EXHAUSTED with a retry-after (a writer stalled on a slow disk must not queue
# requests, and their payloads, without bound)
MAX_PENDING_WRITES = 8192
# Generate requests waiting for a row of the engine; past it Generate answers
# RESOURCE_EXHAUSTED with a retry-after (the recipe's `limits.max_queued_generates`)
MAX_QUEUED_GENERATES = 1024
RETRY_AFTER_KEY = "retry-after-ms"  # trailing metadata of a RESOURCE_EXHAUSTED to wait out
GREEDY_BELOW = 1e-5  # a temperature this small samples greedily (logits / T would overflow)
ACK_CODES = {
    "accepted": pb.Ack.ACCEPTED,
    "duplicate": pb.Ack.DUPLICATE,
    "stale": pb.Ack.STALE,
    "invalid": pb.Ack.INVALID,
    "revision": pb.Ack.REVISION,
    "busy": pb.Ack.BUSY,
}


class SwarmService:
    def __init__(
        self,
        *,
        model_name: str,
        model_source: str,
        limits: Limits,
        max_new_tokens: int,
        max_message_bytes: int,
        engine: Engine,
        store: TrajectoryStore,
        trainer: Trainer,
        metrics: ServerMetrics,
        tokenizer_files: dict[str, bytes],
        chat_template: str,
        eos_token_ids: list[int],
        groups_per_step: int = 1,
        max_queued_generates: int = MAX_QUEUED_GENERATES,
    ) -> None:
        self.model_name = model_name
        self.model_source = model_source
        self.limits = limits
        self.max_new_tokens = max_new_tokens
        self.max_message_bytes = max_message_bytes
        self.engine = engine
        self.store = store
        self.trainer = trainer
        self.metrics = metrics
        self.tokenizer_files = tokenizer_files
        self.chat_template = chat_template
        self.eos_token_ids = eos_token_ids
        self.groups_per_step = groups_per_step
        self.refused_revisions: frozenset[str] = frozenset()
        self.revoked_nodes: frozenset[str] = frozenset()  # the controller's, at each sync
        self.started = time.time()
        self.refused_calls: dict[str, int] = {}
        self.tokens_generated = 0
        self._accepted = RecentRate(window_s=60)  # trajectories accepted, per second
        self._task_labels: set[str] = set()
        self.max_pending_writes = MAX_PENDING_WRITES
        self._pending_writes = 0  # groups in the store's write queue (this loop's count)
        self.max_queued_generates = max_queued_generates
        self._generating = 0  # Generate calls handed to the engine and not answered yet
        self._generate_s = 1.0  # running mean of one Generate's time, its wait included (s)
        tracing.start("jetctl-server", model_name)  # if the environment names a collector

    # --- plumbing --------------------------------------------------------------------

    def handler(self) -> grpc.GenericRpcHandler:
        def ser(m: Any) -> bytes:  # PullWeights yields frames serialized once per version
            return m if isinstance(m, bytes) else m.SerializeToString()  # type: ignore[no-any-return]

        methods = {
            "Register": grpc.unary_unary_rpc_method_handler(self.register, None, ser),
            "Generate": grpc.unary_unary_rpc_method_handler(self.generate, None, ser),
            "Submit": grpc.unary_unary_rpc_method_handler(self.submit, None, ser),
            "SubmitStream": grpc.stream_stream_rpc_method_handler(self.submit_stream, None, ser),
            "PullWeights": grpc.unary_stream_rpc_method_handler(self.pull_weights, None, ser),
            "Status": grpc.unary_unary_rpc_method_handler(self.status, None, ser),
        }
        return grpc.method_handlers_generic_handler(SERVICE, methods)

    def refuse(self, reason: str) -> None:
        self.refused_calls[reason] = self.refused_calls.get(reason, 0) + 1
        self.metrics.refused_calls.labels(reason=reason).inc()

    async def _parse(self, raw: bytes, cls: Any, context: grpc.aio.ServicerContext) -> Any:
        try:
            return cls.FromString(raw)
        except DecodeError as exc:
            self.refuse("malformed")
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, f"malformed {cls.__name__}: {exc}")

    # --- RPCs ------------------------------------------------------------------------

    async def register(self, raw: bytes, context: grpc.aio.ServicerContext) -> pb.RegisterReply:
        req = await self._parse(raw, pb.RegisterRequest, context)
        if req.model and req.model != self.model_name:
            self.refuse("unknown_model")
            await context.abort(
                grpc.StatusCode.INVALID_ARGUMENT,
                f"model {req.model!r} is not served here (this server serves {self.model_name!r})",
            )
        return pb.RegisterReply(
            model=self.model_name,
            model_source=self.model_source,
            model_version=self.trainer.version,
            max_staleness=self.limits.max_staleness,
            max_message_bytes=self.max_message_bytes,
            max_context_tokens=self.limits.max_context_tokens,
            tokenizer_files=self.tokenizer_files,
            chat_template=self.chat_template,
            eos_token_ids=self.eos_token_ids,
            refused_revisions=sorted(self.refused_revisions),
        )

    async def generate(self, raw: bytes, context: grpc.aio.ServicerContext) -> pb.GenerateReply:
        with tracing.generate_handler(context):  # the caller's span's child, when traced
            req = await self._parse(raw, pb.GenerateRequest, context)
            temperature = req.temperature if req.HasField("temperature") else 1.0
            reason = check_generate(
                req.model, req.prompt_ids, req.max_tokens, self.limits, self.max_new_tokens,
                temperature=temperature,
            )
            if reason:
                self.refuse("invalid_generate")
                await context.abort(grpc.StatusCode.INVALID_ARGUMENT, reason)
            await self._check_engine(context)
            prompt = list(req.prompt_ids)  # measured above, so at most max_context_tokens
            room = self.limits.max_context_tokens - len(prompt)
            max_tokens = min(req.max_tokens or self.max_new_tokens, self.max_new_tokens, room)
            self._generating += 1
            t0 = time.monotonic()
            try:
                result = await self.engine.generate(
                    GenRequest(
                        prompt_ids=prompt,
                        max_tokens=max_tokens,
                        temperature=temperature if temperature >= GREEDY_BELOW else 0.0,
                        top_p=req.top_p if 0 < req.top_p <= 1 else 1.0,
                        stop_token_ids=tuple(req.stop_token_ids),
                        seed=req.seed if req.HasField("seed") else None,
                    )
                )
            finally:
                self._generating -= 1
            # a mean over the last ~16 replies: what the retry-after of a refusal is sized by
            self._generate_s += (time.monotonic() - t0 - self._generate_s) / 16
            self.tokens_generated += len(result.completion_ids)
            self.metrics.tokens_generated.inc(len(result.completion_ids))
            return pb.GenerateReply(
                completion_ids=result.completion_ids,
                completion_logprobs=result.completion_logprobs,
                model_version=result.model_version,
                finish_reason=result.finish_reason,
                load=self.load(),
            )

    async def _check_engine(self, context: grpc.aio.ServicerContext) -> None:
        """Past `max_queued_generates` calls waiting for a row of the engine, refuse the
        call with RESOURCE_EXHAUSTED and how long to wait (`retry-after-ms`, trailing
        metadata), as `_check_writer` does for Submit: the node's transport waits and
        calls again, and the rollout goes on. A queue without a bound would hold every
        hostile or runaway caller's request, and its reply would come after the caller's
        own deadline anyway."""
        load = self.engine.load()
        # calls beyond the rows the engine generates at once (an engine that does not say
        # how many that is, max_rows 0, counts every call it holds)
        waiting = max(0, self._generating - load.max_rows)
        self.metrics.generates_waiting.set(waiting)
        if waiting < self.max_queued_generates:
            return
        self.refuse("engine_busy")
        # the time for the calls ahead to be answered: by Little's law the engine answers
        # about `_generating / _generate_s` calls a second (the mean time measured includes
        # the wait for a row); a measured rate, not a promise, within 0.1 .. 5 s
        per_s = max(1, self._generating) / max(self._generate_s, 1e-3)
        retry_ms = int(min(5000, max(100, 1000 * waiting / per_s)))
        await context.abort(
            grpc.StatusCode.RESOURCE_EXHAUSTED,
            f"the engine has {waiting} Generate calls waiting (at most "
            f"{self.max_queued_generates}, limits.max_queued_generates): call again in "
            f"{retry_ms} ms",
            trailing_metadata=((RETRY_AFTER_KEY, str(retry_ms)),),
        )

    def load(self) -> pb.Load:
        """The engine's rows and queue and the trainer's backlog, as nodes size their
        concurrency by them (jetctl.client.concurrency)."""
        engine = self.engine.load()
        return pb.Load(
            engine_rows=engine.rows, engine_max_rows=engine.max_rows,
            engine_queued=engine.queued, buffer_groups=self.store.buffer_depth,
            groups_per_step=self.groups_per_step,
        )

    async def submit(self, raw: bytes, context: grpc.aio.ServicerContext) -> pb.SubmitReply:
        req = await self._parse(raw, pb.SubmitRequest, context)
        await self._check_count(req, context)
        await self._check_writer(context)
        reply = await self._submit(req, raw)
        if reply.acks and all(a.code == pb.Ack.INVALID for a in reply.acks):
            # nothing in the request was usable: refuse the call as a whole
            self.refuse("invalid_submit")
            await context.abort(
                grpc.StatusCode.INVALID_ARGUMENT, "; ".join(a.reason for a in reply.acks)[:2000]
            )
        return reply

    async def submit_stream(
        self, requests: AsyncIterator[bytes], context: grpc.aio.ServicerContext
    ) -> AsyncIterator[pb.SubmitReply]:
        async for raw in requests:
            req = await self._parse(raw, pb.SubmitRequest, context)
            await self._check_count(req, context)
            await self._check_writer(context)
            yield await self._submit(req, raw)

    async def _check_writer(self, context: grpc.aio.ServicerContext) -> None:
        """Past `max_pending_writes` groups waiting for the store's writer, refuse the call
        with RESOURCE_EXHAUSTED and how long to wait (`retry-after-ms`, trailing metadata):
        the client keeps its groups spooled and sends them again then. One comparison of a
        counter this loop keeps: nothing on the Submit path waits for it."""
        if self._pending_writes < self.max_pending_writes:
            return
        self.refuse("store_busy")
        # a quarter of a millisecond per queued group (a guess at a slow disk's commit
        # rate, not a measurement), within 0.1 .. 5 s
        retry_ms = min(5000, max(100, self._pending_writes // 4))
        await context.abort(
            grpc.StatusCode.RESOURCE_EXHAUSTED,
            f"the store's writer has {self._pending_writes} groups queued (at most "
            f"{self.max_pending_writes}): send again in {retry_ms} ms",
            trailing_metadata=((RETRY_AFTER_KEY, str(retry_ms)),),
        )

    async def _check_count(self, req: pb.SubmitRequest, context: grpc.aio.ServicerContext) -> None:
        """Many tiny groups fit under the byte cap; each costs work and an ack: cap them."""
        if len(req.groups) > self.limits.max_groups_per_submit:
            self.refuse("too_many_groups")
            await context.abort(
                grpc.StatusCode.RESOURCE_EXHAUSTED,
                f"{len(req.groups)} groups in one Submit > {self.limits.max_groups_per_submit}: "
                "send them in several calls",
            )

    def _task_label(self, task: str) -> str:
        if task in self._task_labels:
            return task
        if not task or len(task) > 64 or len(self._task_labels) >= MAX_TASK_LABELS:
            return "?" if not task else "other"
        self._task_labels.add(task)
        return task

    async def _submit(self, req: pb.SubmitRequest, raw: bytes) -> pb.SubmitReply:
        """Judge each group as the message it arrived in; store its bytes; ack when durable."""
        if not req.groups:
            return pb.SubmitReply(model_version=self.trainer.version)
        version = self.trainer.version
        pending: list[tuple[int, str, int]] = []  # ack index, group id, trajectories
        puts: list[Put] = []
        acks: list[pb.Ack | None] = []
        groups = req.groups
        verdicts = check_groups(groups, packed_groups(raw, len(groups)), self.limits, version,
                                self.refused_revisions)
        for gm, payload, verdict in zip(groups, group_payloads(raw, req), verdicts):
            n_traj = len(gm.trajectories)
            self.metrics.received.labels(task=self._task_label(gm.task)).inc(n_traj)
            # an id this long is refused; echoing it whole could push the reply past the cap
            gid = gm.id[: self.limits.max_id_chars]
            if verdict.facts is None:
                # a resend of a group stored before (its ack was lost, and e.g. a restart
                # from an older checkpoint makes its versions look ahead): its outcome stands
                known = self.store.recorded(gid) if gid and gid == gm.id else None
                if known is not None:
                    acks.append(pb.Ack(group_id=gid, code=ACK_CODES[known.outcome],
                                       reason=known.reason))
                    continue
                # invalid groups are not stored: they may be garbage of any size
                self.metrics.rejected.labels(reason="invalid").inc(n_traj)
                acks.append(pb.Ack(group_id=gid, code=pb.Ack.INVALID, reason=verdict.reason))
                continue
            self.metrics.version_lag.observe(max(verdict.facts.lag(version), 0))
            stored = payload if verdict.outcome == "accepted" else b""
            puts.append(Put(verdict.facts, stored, verdict.outcome, verdict.reason))  # type: ignore[arg-type]
            pending.append((len(acks), verdict.facts.id, n_traj))
            acks.append(None)
        # one future for the request's groups: one wake-up of this loop, not one per group
        self._pending_writes += len(puts)
        try:
            results = await asyncio.wrap_future(self.store.put_many(puts)) if puts else []
        finally:
            self._pending_writes -= len(puts)
        for (index, group_id, n_traj), res in zip(pending, results):
            if res.outcome == "accepted":
                self._accepted.add(n_traj)
            elif res.outcome == "busy":
                self.metrics.deferred.inc(n_traj)
            elif res.outcome != "duplicate":
                self.metrics.rejected.labels(reason=res.outcome).inc(n_traj)
            acks[index] = pb.Ack(group_id=group_id, code=ACK_CODES[res.outcome], reason=res.reason)
        self.metrics.buffer_groups.set(self.store.buffer_depth)
        tracing.admission(groups, acks)  # each verdict, in its trajectories' traces
        return pb.SubmitReply(acks=cast(list[pb.Ack], acks), model_version=self.trainer.version)

    async def pull_weights(
        self, raw: bytes, context: grpc.aio.ServicerContext
    ) -> AsyncIterator[bytes]:
        req = await self._parse(raw, pb.PullWeightsRequest, context)
        if req.have_version == self.trainer.version:
            return
        t0 = time.monotonic()
        try:
            frames = await asyncio.to_thread(self._weight_frames)
        except TimeoutError as e:  # a hung step holds the weights: fail loudly, never stall
            log.error("PullWeights: %s", e)
            await context.abort(grpc.StatusCode.UNAVAILABLE, f"weights not available: {e}")
        for frame in frames:
            yield frame
        self.metrics.publish_seconds.observe(time.monotonic() - t0)

    def _weight_frames(self) -> list[bytes]:
        """The current version's serialized WeightsChunk messages (the trainer makes them
        once per version)."""
        chunk = max(1, min(CHUNK_BYTES, self.max_message_bytes - CHUNK_FRAMING))
        return self.trainer.weight_frames(chunk)

    async def status(self, raw: bytes, context: grpc.aio.ServicerContext) -> pb.StatusReply:
        await self._parse(raw, pb.StatusRequest, context)
        # running counters (store.py): no scan, no wait for the store's writer
        counts = self.store.counts()
        by_task = self.store.received_by_task()
        reward_by_task = self.store.reward_by_task()
        f = self.trainer.figures
        window = min(60.0, max(time.time() - self.started, 1e-3))
        recent = f.recent_rewards[-64:]
        no_signal, signal = f.signal()
        verdicts = f.signal_by_task()
        mix = self.trainer.mix
        mixed = mix.figures() if mix is not None else {}
        return pb.StatusReply(
            model=self.model_name,
            model_source=self.model_source,
            model_version=self.trainer.version,
            buffer_groups=self.store.buffer_depth,
            accepted_groups=sum(counts.groups.values()),
            accepted_trajectories=sum(counts.trajectories.values()),
            rejected=counts.rejected_trajectories,
            trained_trajectories=counts.trajectories.get("trained", 0),
            trained_groups=counts.groups.get("trained", 0),
            reward_mean_recent=sum(recent) / len(recent) if recent else 0.0,
            trajectories_per_second=self._accepted.total() / window,
            tokens_generated=self.tokens_generated,
            last_checkpoint_version=f.last_checkpoint_version,
            uptime_s=time.time() - self.started,
            refused_calls=self.refused_calls,
            last_step=f.last_step,
            pid=os.getpid(),
            received_by_task=by_task,
            reward_by_task=reward_by_task,
            rejected_groups=counts.rejected_groups,
            no_signal_recent=no_signal,
            signal=signal,
            skipped_groups=f.skipped_groups,
            batch_share_by_task={t: m["share"] for t, m in mixed.items()},
            backfilled_by_task=dict(mix.backfilled_total) if mix is not None else {},
            starving_tasks=sorted(t for t, m in mixed.items() if m["starving"]),
            staleness_by_task=f.staleness_by_task(),
            no_signal_by_task={t: share for t, (share, _) in verdicts.items()},
            signal_by_task={t: verdict for t, (_, verdict) in verdicts.items()},
        )


def auth_interceptor(
    token: str, on_refuse: Callable[[str], None], model: str | None = None,
    revoked: Callable[[str], bool] = lambda _node: False,
) -> grpc.aio.ServerInterceptor:
    """Require a valid token of the run on every call but health and reflection: the run
    token for any call, a node credential (jetctl.auth) for the client calls of `model`
    only, until the node is `revoked`. A wrong token is UNAUTHENTICATED, a node's call
    outside its scope or after its revocation PERMISSION_DENIED; each is counted
    (`refused_calls`)."""
    open_prefixes = ("/grpc.health.v1.Health/", "/grpc.reflection.")

    class _Auth(grpc.aio.ServerInterceptor):
        async def intercept_service(
            self,
            continuation: Callable[[grpc.HandlerCallDetails], Awaitable[grpc.RpcMethodHandler]],
            details: grpc.HandlerCallDetails,
        ) -> grpc.RpcMethodHandler:
            if details.method.startswith(open_prefixes):
                return await continuation(details)
            who = metadata_principal(details.invocation_metadata, token)
            if who is None:
                on_refuse("unauthenticated")
                return _deny(details.method)
            if not who.may_call(details.method, model if model is not None else ""):
                on_refuse("permission_denied")
                return _deny(details.method, grpc.StatusCode.PERMISSION_DENIED,
                             f"node {who.node}'s credential does not allow {details.method}")
            if who.node is not None and revoked(who.node):
                on_refuse("revoked")
                return _deny(details.method, grpc.StatusCode.PERMISSION_DENIED,
                             f"node {who.node}'s credential was revoked (it left the run)")
            return await continuation(details)

    return _Auth()


def _deny(
    method: str, code: grpc.StatusCode = grpc.StatusCode.UNAUTHENTICATED,
    msg: str = "missing or wrong bearer token (see <run dir>/token)",
) -> grpc.RpcMethodHandler:
    async def unary(request: Any, context: grpc.aio.ServicerContext) -> Any:
        await context.abort(code, msg)

    async def stream(request: Any, context: grpc.aio.ServicerContext) -> Any:
        await context.abort(code, msg)
        yield  # pragma: no cover

    if method.endswith(("SubmitStream",)):
        return grpc.stream_stream_rpc_method_handler(stream)
    if method.endswith("PullWeights"):
        return grpc.unary_stream_rpc_method_handler(stream)
    return grpc.unary_unary_rpc_method_handler(unary)
