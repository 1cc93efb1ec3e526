"""Everything a client node does to get its groups to one model's swarm server: the gRPC
transport (`grpc.aio`), and below it Delivery, which sends the spooled groups until each
has an ack.

Transport
---------

* The endpoint comes from the controller (`endpoint_source`, the node's control link), or
  from `<run_dir>/servers/<model>.json` for a node without one, and is looked up again
  whenever a call fails with UNAVAILABLE, since the controller may restart the server (same
  port usually, another host:port possibly).
* `register` waits for a server that does not listen yet (gRPC `wait_for_ready`, within
  its call timeout, then retried like `submit`): the controller starts a node together with
  its servers, so a node's first Register usually waits out a server loading its model. The
  channel tries to connect again at most `RECONNECT_MAX_MS` apart, so a server that starts
  listening is found within about a second.
* Every call carries the run's bearer token (`jetctl.auth.bearer`) and a deadline.
* Keepalive pings every 10 s (5 s timeout, also without calls) detect a dead link; the
  server must permit that ping rate.
* Message caps: 64 MiB until `register()`, then the server's `max_message_bytes` both ways.
* `submit` takes groups as the spool stores them (each one's serialized `TrajectoryGroup`)
  and sends those bytes as they are: a `SubmitRequest` on the wire is its groups' bytes,
  each behind field 1's tag and its length (`submit_request_bytes`), so nothing is parsed
  and serialized again on the way out. It retries UNAVAILABLE / DEADLINE_EXCEEDED with capped exponential backoff and full
  jitter (tenacity). Resending is safe: group ids are idempotency keys and a group the
  server already holds comes back DUPLICATE. The acks themselves (STALE, INVALID, REVISION)
  are final and returned as they are; deciding what to do with them is the node's job.
* `generate` waits out a busy engine's RESOURCE_EXHAUSTED for the `retry-after-ms` it
  names (plus up to half again, jitter) and calls again, within `generate_timeout_s`.
* `pull_weights` writes the streamed chunks into one buffer and checks size and sha256.

* With `run.tls` on (`tls=TlsFiles`), the channel is a secure one that trusts the run CA
  and, in mtls, presents the client certificate (jetctl.tls).

Left out: SubmitStream.

Delivery
--------

A node's spooled groups pushed to the model's server until each has an ack.

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
import hashlib
import logging
import random
import sys
import threading
import time
from collections.abc import Awaitable, Callable, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, TypeVar

import grpc
import numpy as np
from google.protobuf.message import DecodeError
from tenacity import (
    AsyncRetrying,
    retry_if_exception,
    stop_after_attempt,
    stop_after_delay,
    wait_random_exponential,
)

from jetctl import tracing
from jetctl.auth import bearer
from jetctl.client.backend import BackendError, GenerateParams, GenerateResult
from jetctl.client.metrics import ClientMetrics, NodeStats
from jetctl.client.spool import Outcome, PendingGroup, Spool
from jetctl.costs import NodeWaste
from jetctl.proto._gen import swarm_pb2 as pb
from jetctl.proto._gen import swarm_pb2_grpc as pb_grpc
from jetctl.proto.convert import ChunkView, read_weights_chunk
from jetctl.rundir import RunPaths, read_json
from jetctl.tls import TlsFiles

if TYPE_CHECKING:
    from jetctl.client.concurrency import Governor

log = logging.getLogger(__name__)

T = TypeVar("T")

RETRYABLE = (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED)
BOOTSTRAP_MESSAGE_BYTES = 64 * 1024 * 1024
PULL_WEIGHTS = "/jetctl.swarm.v1.Swarm/PullWeights"
SUBMIT = "/jetctl.swarm.v1.Swarm/Submit"
_SUBMIT_GROUPS_TAG = b"\x0a"  # SubmitRequest.groups: field 1, wire type 2 (length-delimited)
# the longest wait between a channel's connection attempts: a connect to a server that is
# not up yet costs a refused SYN, and a node waiting out a server's start finds it this soon
RECONNECT_MAX_MS = 1_000


def submit_request_bytes(groups: Sequence[pb.TrajectoryGroup | bytes]) -> bytes:
    """The serialized `SubmitRequest` of `groups`: a repeated message field is encoded as
    each element's bytes behind the field's tag and a varint length, so serialized groups
    are joined as they are (the protobuf encoding guide, "Embedded messages")."""
    out = bytearray()
    for g in groups:
        payload = g if isinstance(g, bytes) else g.SerializeToString()
        out += _SUBMIT_GROUPS_TAG
        n = len(payload)
        while n >= 0x80:  # base-128 varint, low groups first
            out.append((n & 0x7F) | 0x80)
            n >>= 7
        out.append(n)
        out += payload
    return bytes(out)


class _Parsed(Sequence[pb.TrajectoryGroup]):
    """Groups as messages, parsed only when read (tracing reads them only when on)."""

    def __init__(self, groups: Sequence[pb.TrajectoryGroup | bytes]) -> None:
        self._groups = groups

    def __len__(self) -> int:
        return len(self._groups)

    def __getitem__(self, i: int) -> pb.TrajectoryGroup:  # type: ignore[override]
        g = self._groups[i]
        return pb.TrajectoryGroup.FromString(g) if isinstance(g, bytes) else g


class EndpointNotFound(Exception):
    """The server has not written `servers/<model>.json` yet (or it holds no endpoint)."""


class WeightsError(Exception):
    """A PullWeights stream that does not add up (size or sha256 mismatch)."""


@dataclass(frozen=True)
class RetryPolicy:
    """Capped exponential backoff with full jitter: wait ~ U(0, min(max_s, base_s * 2**n))."""

    attempts: int = 8
    base_s: float = 0.25
    max_s: float = 10.0
    total_s: float = 60.0  # give up (and leave the group in the spool) after this long


@dataclass(frozen=True)
class Weights:
    """One version's weights as PullWeights delivered them (verified)."""

    version: int
    kind: str  # full | lora
    format: str  # safetensors
    data: memoryview  # the one buffer the chunks were written into (tensors view it, no copy)
    sha256: str
    adapter_config_json: str


def _payload_buffer(total_bytes: int) -> np.ndarray:
    """A new buffer for a payload of `total_bytes`, not written to: its pages are mapped as
    the worker copies chunks into them (`bytearray(n)` zeroes every page first, which cost
    the receiving loop 0.6 s of a 1.5 s pull of 538 MB)."""
    if total_bytes < 0:
        raise WeightsError(f"PullWeights announced total_bytes={total_bytes}")
    try:
        return np.empty(total_bytes, dtype=np.uint8)
    except (MemoryError, ValueError):
        raise WeightsError(
            f"PullWeights announced total_bytes={total_bytes}, more than this node can hold"
        ) from None


class PayloadBuffers:
    """A payload buffer kept for the next pull of the same size.

    Writing into fresh memory faults every page in: on the 2-core build VM a new 512 MB
    buffer took copies at 0.3-0.9 GB/s against ~18 GB/s into pages already mapped, most of a
    pull's client CPU. A node pulls every version at the same size, and the local engine
    copies the tensors into its model (`LocalEngine.apply`) and drops the payload, so the
    next pull can write into the previous one's buffer, its pages already mapped.

    A buffer is reused only when nothing views it any more: its `Weights`, a memoryview of
    it and every tensor made from it hold a reference to the array, so a reference count of
    the pool's own is proof (tests/client/test_client_transport.py). At most `keep` buffers of
    at most `max_bytes` each are held, the newest; a bigger payload (a model of billions of
    parameters) gets a buffer of its own that is freed with its last view, so a node never
    holds an idle copy of such a model.
    """

    def __init__(self, keep: int = 1, max_bytes: int = 2 << 30) -> None:
        self.keep = keep
        self.max_bytes = max_bytes
        self._held: list[np.ndarray] = []
        self._lock = threading.Lock()
        self.reused = 0  # pulls that wrote into a held buffer

    def take(self, total_bytes: int) -> np.ndarray:
        """A buffer of `total_bytes` that nothing else references: a held one, or a new one."""
        with self._lock:
            for i in range(len(self._held)):
                # two references: the list's and getrefcount's own argument
                if self._held[i].nbytes == total_bytes and sys.getrefcount(self._held[i]) <= 2:
                    buffer = self._held.pop(i)
                    self._held.append(buffer)
                    self.reused += 1
                    return buffer
            buffer = _payload_buffer(total_bytes)
            if total_bytes <= self.max_bytes and self.keep > 0:
                self._held.append(buffer)
                del self._held[: -self.keep]
            return buffer

    def clear(self) -> None:
        with self._lock:
            self._held.clear()


PAYLOAD_BUFFERS = PayloadBuffers()  # one per process: every transport's pulls share them


def _copy_and_hash(
    target: np.ndarray, offset: int, data: memoryview, digest: hashlib._Hash
) -> None:
    """Write one chunk at `offset` of the payload and add it to the digest (in order)."""
    if len(data):
        np.copyto(target[offset : offset + len(data)], np.frombuffer(data, dtype=np.uint8))
        digest.update(data)  # just read by the copy: from the cache


def read_endpoint(run_dir: Path, model: str) -> str:
    """host:port of `model`'s server from `<run_dir>/servers/<model>.json`."""
    path = RunPaths(Path(run_dir)).server_file(model)
    if not path.is_file():
        raise EndpointNotFound(f"{path} does not exist yet (is the server for {model!r} up?)")
    info = read_json(path)  # written atomically: None only for a foreign or broken file
    if info is None:
        raise EndpointNotFound(f"{path} is not a JSON object")
    endpoint = info.get("endpoint")
    if not isinstance(endpoint, str) or not endpoint:
        raise EndpointNotFound(f"{path} has no endpoint")
    return endpoint


RETRY_AFTER_KEY = "retry-after-ms"  # jetctl.server.service's, on a RESOURCE_EXHAUSTED


def retry_after_s(exc: BaseException) -> float | None:
    """The wait a server asked for with a RESOURCE_EXHAUSTED (its store's writer or its
    engine's queue is full), or None when the error is not such a refusal."""
    if not isinstance(exc, grpc.aio.AioRpcError):
        return None
    if exc.code() != grpc.StatusCode.RESOURCE_EXHAUSTED:
        return None
    for key, value in exc.trailing_metadata() or ():
        if key == RETRY_AFTER_KEY:
            try:
                return max(0.0, int(value) / 1000)
            except (TypeError, ValueError):
                return None
    return None


def is_retryable(exc: BaseException) -> bool:
    return isinstance(exc, grpc.aio.AioRpcError) and exc.code() in RETRYABLE


class SwarmTransport:
    """One model's server, seen from a client node. Create, then `await register(...)`."""

    def __init__(
        self,
        model: str,
        token: str,
        *,
        run_dir: Path | None = None,
        endpoint: str | None = None,
        endpoint_source: Callable[[], str] | None = None,
        call_timeout_s: float = 30.0,
        generate_timeout_s: float = 300.0,
        retry: RetryPolicy = RetryPolicy(),
        tls: TlsFiles | None = None,
    ) -> None:
        if run_dir is None and endpoint is None and endpoint_source is None:
            raise ValueError(
                "give endpoint_source, run_dir (to read servers/<model>.json) or an endpoint"
            )
        self.model = model
        self._token = token
        self._run_dir = run_dir
        self._fixed_endpoint = endpoint
        self._endpoint_source = endpoint_source
        # read once: a missing file fails here, at construction, not at the first call
        self._credentials = tls.channel_credentials() if tls is not None else None
        self.call_timeout_s = call_timeout_s
        self.generate_timeout_s = generate_timeout_s
        self.retry = retry
        self.max_message_bytes = BOOTSTRAP_MESSAGE_BYTES
        self.endpoint: str | None = None
        self.reachable = False
        self.answered = False  # the server answered a call once (it was up at some point)
        self.busy_waits = 0  # Generates refused by a busy engine, waited out and made again
        self._channel: grpc.aio.Channel | None = None
        self._stub: pb_grpc.SwarmStub | None = None
        # replaced channels, closing once their calls finished (or after a grace)
        self._retired: dict[asyncio.Task[None], grpc.aio.Channel] = {}

    # ------------------------------------------------------------------ channel

    def _options(self) -> list[tuple[str, int]]:
        return [
            ("grpc.keepalive_time_ms", 10_000),
            ("grpc.keepalive_timeout_ms", 5_000),
            ("grpc.keepalive_permit_without_calls", 1),
            ("grpc.http2.max_pings_without_data", 0),
            ("grpc.max_send_message_length", self.max_message_bytes),
            ("grpc.max_receive_message_length", self.max_message_bytes),
            # reconnect quickly after a server restart
            ("grpc.initial_reconnect_backoff_ms", 200),
            ("grpc.max_reconnect_backoff_ms", RECONNECT_MAX_MS),
        ]

    def _current_endpoint(self) -> str:
        if self._fixed_endpoint is not None:
            return self._fixed_endpoint
        if self._endpoint_source is not None:
            endpoint = self._endpoint_source()
            if not endpoint:
                raise EndpointNotFound(
                    f"the controller has not given an endpoint of {self.model!r}'s server yet"
                )
            return endpoint
        assert self._run_dir is not None
        return read_endpoint(self._run_dir, self.model)

    async def _ensure_channel(self, *, reread: bool = False) -> pb_grpc.SwarmStub:
        """The stub; (re)opens the channel when none is open or the endpoint file changed."""
        if self._stub is not None and not reread:
            return self._stub
        endpoint = self._current_endpoint()
        if self._stub is not None and endpoint == self.endpoint:
            return self._stub
        self._retire_channel()
        self.endpoint = endpoint
        if self._credentials is None:
            self._channel = grpc.aio.insecure_channel(endpoint, options=self._options())
        else:
            self._channel = grpc.aio.secure_channel(
                endpoint, self._credentials, options=self._options()
            )
        self._stub = pb_grpc.SwarmStub(self._channel)
        return self._stub

    def _retire_channel(self) -> None:
        """Stop using the open channel; calls already on it finish on it.

        Closing a grpc.aio channel cancels its calls: the caller of each gets a bare
        `asyncio.CancelledError`, which a sender takes for its own cancellation. A node's
        sender can have a Submit on the channel while `register` replaces it (the groups of
        an earlier process of the node go out before it registers), so the old channel is
        closed in the background with a grace of one call timeout instead."""
        if self._channel is None:
            return
        old, self._channel, self._stub = self._channel, None, None
        closing = asyncio.get_running_loop().create_task(old.close(grace=self.call_timeout_s))
        self._retired[closing] = old
        closing.add_done_callback(lambda t: self._retired.pop(t, None))

    async def close(self) -> None:
        """Close the channel and any retired one now (their calls are cancelled)."""
        if self._channel is not None:
            await self._channel.close()
        self._channel = None
        self._stub = None
        for closing, channel in list(self._retired.items()):
            closing.cancel()
            await channel.close()

    def _metadata(self) -> tuple[tuple[str, str]]:
        return bearer(self._token)

    def _note(self, exc: BaseException | None) -> None:
        """Track reachability: any answer from the server means it is reachable."""
        if exc is None:
            self.reachable = True
        elif isinstance(exc, grpc.aio.AioRpcError):
            self.reachable = exc.code() not in RETRYABLE
        elif isinstance(exc, EndpointNotFound):
            self.reachable = False
        self.answered = self.answered or self.reachable

    async def _before_retry(self) -> None:
        """The server may have restarted elsewhere: re-read its endpoint file."""
        try:
            await self._ensure_channel(reread=True)
        except EndpointNotFound as e:
            log.info("server endpoint for %s not available: %s", self.model, e)

    # ------------------------------------------------------------------ RPCs

    async def register(self, client_id: str, task: str, revision: str) -> pb.RegisterReply:
        """Say who we are; adopt the server's message cap. Each call waits for a server that
        does not listen yet (`wait_for_ready`, up to `call_timeout_s`); retried like `submit`."""
        request = pb.RegisterRequest(
            client_id=client_id, task=task, client_revision=revision, model=self.model
        )

        async def call(stub: pb_grpc.SwarmStub) -> pb.RegisterReply:
            return await stub.Register(
                request, metadata=self._metadata(), timeout=self.call_timeout_s,
                wait_for_ready=True,
            )

        reply: pb.RegisterReply = await self._retrying(call)
        if reply.max_message_bytes > 0 and reply.max_message_bytes != self.max_message_bytes:
            self.max_message_bytes = int(reply.max_message_bytes)
            self._retire_channel()  # reopened with the new cap on the next call
            await self._ensure_channel()
        return reply

    async def generate(self, request: pb.GenerateRequest) -> pb.GenerateReply:
        """One Generate; UNAVAILABLE is retried a few times (the server may be restarting).
        A busy engine's refusal (RESOURCE_EXHAUSTED with a retry-after) is waited out and
        the call made again, within `generate_timeout_s` in all: the server keeps its queue
        bounded, and the rollout waits instead of failing."""

        async def call(stub: pb_grpc.SwarmStub) -> pb.GenerateReply:
            with tracing.generate_call() as traced:  # () unless traced: the span's context
                return await stub.Generate(
                    request, metadata=self._metadata() + traced, timeout=self.generate_timeout_s
                )

        policy = RetryPolicy(attempts=4, base_s=0.2, max_s=2.0, total_s=10.0)
        deadline = time.monotonic() + self.generate_timeout_s
        while True:
            try:
                result: pb.GenerateReply = await self._retrying(
                    call, policy=policy, codes=(grpc.StatusCode.UNAVAILABLE,)
                )
                return result
            except grpc.aio.AioRpcError as e:
                wait_s = retry_after_s(e)
                if wait_s is None or time.monotonic() + wait_s > deadline:
                    raise
            self.busy_waits += 1
            # up to half again as long: nodes refused together do not all come back together
            await asyncio.sleep(wait_s * random.uniform(1.0, 1.5))

    async def submit(self, groups: Sequence[pb.TrajectoryGroup | bytes]) -> pb.SubmitReply:
        """Send groups (messages, or serialized `TrajectoryGroup`s sent as they are), get
        one ack per group. Raises `grpc.aio.AioRpcError` after retries."""
        request = submit_request_bytes(groups)

        async def call(stub: pb_grpc.SwarmStub) -> pb.SubmitReply:
            assert self._channel is not None  # opened with the stub
            submit = self._channel.unary_unary(
                SUBMIT, request_serializer=None, response_deserializer=pb.SubmitReply.FromString
            )
            reply: pb.SubmitReply = await submit(
                request, metadata=self._metadata(), timeout=self.call_timeout_s
            )
            return reply

        with tracing.submit_call(_Parsed(groups)):
            return await self._retrying(call)

    async def pull_weights(self, have_version: int) -> Weights | None:
        """The server's current weights if newer than `have_version`, else None."""
        await self._ensure_channel()
        assert self._channel is not None
        # raw frames, read by `read_weights_chunk`: each chunk's data stays a view into the
        # bytes gRPC delivered until the one join at the end
        pull = self._channel.unary_stream(
            PULL_WEIGHTS, request_serializer=pb.PullWeightsRequest.SerializeToString,
            response_deserializer=None,
        )
        stream = pull(
            pb.PullWeightsRequest(have_version=have_version),
            metadata=self._metadata(),
            timeout=max(self.call_timeout_s, 600.0),
        )
        # each chunk is copied into one buffer of the announced size and hashed as it
        # arrives, in a worker thread (one, so in order): numpy's copy and hashlib both drop
        # the GIL, so they run on another core while this loop receives the next chunks, and
        # each frame is freed once copied (its memory serves the next frames); no join at the
        # end, and the buffer is what the local engine loads its tensors from
        digest = hashlib.sha256()
        worker = ThreadPoolExecutor(1, thread_name_prefix="pull-sha256")
        taken: list[Future[None]] = []
        buffer: np.ndarray | None = None
        received = 0
        first: ChunkView | None = None
        try:
            async for frame in stream:
                try:
                    chunk = read_weights_chunk(frame)
                except ValueError as e:
                    raise WeightsError(f"PullWeights sent a malformed chunk: {e}") from None
                if first is None:
                    first = chunk
                    buffer = PAYLOAD_BUFFERS.take(first.total_bytes)
                assert buffer is not None
                if chunk.version != first.version or chunk.sha256 != first.sha256:
                    raise WeightsError("PullWeights chunks of different versions in one stream")
                if chunk.offset != received:
                    raise WeightsError(
                        f"PullWeights chunk at offset {chunk.offset}, expected {received}"
                    )
                data = chunk.data
                if received + len(data) > first.total_bytes:
                    raise WeightsError(
                        f"PullWeights sent more than total_bytes={first.total_bytes}"
                    )
                taken.append(worker.submit(_copy_and_hash, buffer, received, data, digest))
                received += len(data)
            if taken:
                await asyncio.wrap_future(taken[-1])  # the last chunk: every one before is done
                for done in taken:
                    done.result()  # raises what a copy raised
        except grpc.aio.AioRpcError as e:
            self._note(e)
            raise
        finally:
            worker.shutdown(wait=False, cancel_futures=True)
        self._note(None)
        if first is None or buffer is None:
            return None
        if received != first.total_bytes:
            raise WeightsError(f"PullWeights sent {received} of {first.total_bytes} bytes")
        if digest.hexdigest() != first.sha256:
            raise WeightsError(f"weights sha256 {digest.hexdigest()} != announced {first.sha256}")
        return Weights(
            version=first.version,
            kind=first.kind,
            format=first.format,
            data=buffer.data,
            sha256=first.sha256,
            adapter_config_json=first.adapter_config_json,
        )

    async def _retrying(
        self,
        call: Callable[[pb_grpc.SwarmStub], Awaitable[T]],
        *,
        policy: RetryPolicy | None = None,
        codes: tuple[grpc.StatusCode, ...] = RETRYABLE,
    ) -> T:
        """Run `call(stub)` with capped exponential backoff and jitter on `codes`."""
        p = policy or self.retry

        def retryable(exc: BaseException) -> bool:
            return isinstance(exc, EndpointNotFound) or (
                isinstance(exc, grpc.aio.AioRpcError) and exc.code() in codes
            )

        async for attempt in AsyncRetrying(
            retry=retry_if_exception(retryable),
            wait=wait_random_exponential(multiplier=p.base_s, max=p.max_s),
            stop=stop_after_attempt(p.attempts) | stop_after_delay(p.total_s),
            reraise=True,
        ):
            with attempt:
                if attempt.retry_state.attempt_number > 1:
                    await self._before_retry()
                try:
                    stub = await self._ensure_channel()
                    result = await call(stub)
                except (grpc.aio.AioRpcError, EndpointNotFound) as e:
                    self._note(e)
                    raise
                self._note(None)
                return result
        raise AssertionError("unreachable: tenacity reraises the last error")


async def wait_for_endpoint(
    run_dir: Path, model: str, stop: asyncio.Event, poll_s: float = 0.5
) -> str:
    """Wait until the server has written its endpoint file (or `stop` is set)."""
    while not stop.is_set():
        try:
            return read_endpoint(run_dir, model)
        except EndpointNotFound:
            await asyncio.sleep(poll_s)
    raise EndpointNotFound(f"stopped before the server for {model!r} wrote its endpoint")


class ServerBackend:
    """The proxy's `Backend` for `inference: server`: Generate on the model's server."""

    def __init__(self, transport: SwarmTransport, governor: Governor | None = None) -> None:
        self.transport = transport
        self.governor = governor  # concurrency: auto reads each reply's Load

    async def generate(self, params: GenerateParams) -> GenerateResult:
        request = pb.GenerateRequest(
            model=self.transport.model,
            prompt_ids=params.prompt_ids,
            max_tokens=params.max_tokens,
            temperature=params.temperature,
            top_p=params.top_p,
            stop_token_ids=params.stop_token_ids,
            request_id=params.request_id,
            seed=params.seed,  # None: the field stays absent (unseeded)
        )
        try:
            reply = await self.transport.generate(request)
        except EndpointNotFound as e:
            raise BackendError(str(e)) from e
        except grpc.aio.AioRpcError as e:
            # a busy engine (a retry-after) outlasting generate_timeout_s is the server's
            # state, not the request's fault: 503, which the OpenAI SDK retries
            status = (
                400
                if e.code()
                in (grpc.StatusCode.INVALID_ARGUMENT, grpc.StatusCode.RESOURCE_EXHAUSTED)
                and retry_after_s(e) is None
                else 503
            )
            raise BackendError(
                f"Generate failed: {e.code().name}: {e.details()}", status=status
            ) from e
        if self.governor is not None and reply.HasField("load"):
            self.governor.observe(reply.load)
        return GenerateResult(
            completion_ids=list(reply.completion_ids),
            completion_logprobs=list(reply.completion_logprobs),
            model_version=int(reply.model_version),
            finish_reason=reply.finish_reason or "stop",
        )


# ---------------------------------------------------------------------------------------
# Delivery: a node's spooled groups pushed to the model's server until each has an ack
# (formerly jetctl/client/delivery.py; see the module docstring's Delivery section).
# ---------------------------------------------------------------------------------------

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
        self._submit_since = time.monotonic()  # the status's liveness check (`reachable`)
        try:
            reply = await self.transport.submit([i.payload for i in batch])  # sent as stored
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
        finally:
            self._submit_since = None  # answered, failed or cancelled: no Submit under way
        seconds = time.perf_counter() - t0
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
        recorded = 0
        for item in batch:
            ack = acks.get(item.id)
            outcome = ACK_OUTCOME.get(ack.code) if ack is not None else None
            if ack is None or outcome is None:  # e.g. the server's buffer full: sent again
                self.spool.defer(item.id, self._resend_delay(item.attempts))
                continue
            self._record_ack(item, outcome, ack.reason)
            recorded += 1
        if self._on_acked is not None:
            # only groups with an outcome: a deferred one is counted when it gets one
            self._on_acked(seconds, recorded)
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
