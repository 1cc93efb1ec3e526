"""The client node loop: tasks in, rollouts run, groups spooled, groups pushed.

    node = ClientNode(NodeConfig(name="digits-0", task_name="digits", task=task_cfg,
                                 run_dir=Path("runs/x"), token=token))
    exit_code = asyncio.run(node.run())

What one node does (docs/architecture.md sections 1, 2, 6):

1. Register with the task's model server (endpoint from `<run_dir>/servers/<model>.json`,
   retried until it answers) and rebuild its tokenizer from the reply.
2. Start the OpenAI-compatible proxy (timelines), /metrics, the sender and the status file.
3. Draw tasks from `make_env(**env_args).tasks(random.Random(seed + index))`; for each run
   `group_size` rollouts concurrently (at most `concurrency` at once on the node, each in a
   killable process, see rollout.py) and build the `TrajectoryGroup` of the ok ones. Failed
   and timed-out trajectories are recorded in the spool's `dropped` table with their error;
   a group with fewer than 2 ok trajectories is dropped whole (GRPO needs a comparison).
4. Spool each group (durable), and let the sender push due groups in batches; a group
   leaves the spool only on an ack; transport errors defer it with capped exponential
   backoff + jitter; while the link is down the oldest group is resent every `probe_s` and
   the first ack makes every deferred group due again. Rollouts never wait for training;
   they wait only when the spool holds more than `spool_max_bytes` (back-pressure; nothing
   un-acked is ever deleted). Trajectory ids are recorded in the spool before their
   rollouts start; rollouts a killed process left running are recorded `dropped(lost)`.
5. SIGTERM (or `drain()`): stop taking tasks, let in-flight rollouts finish or time out,
   flush the spool within `drain_grace_s`, exit 0. What is left stays in the spool file and
   is sent by the next node of the same name.

Left out: multi-model teams (one node serves its task's model; requests naming any other
model are answered by it too) and SubmitStream.
"""

from __future__ import annotations

import asyncio
import json
import logging
import math
import os
import random
import signal
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import grpc

from jetctl.client.metrics import ClientMetrics
from jetctl.client.proxy import Backend, Proxy, Sampling, ServedModel
from jetctl.client.rollout import (
    RolloutResult,
    RolloutRunner,
    RolloutSpec,
    load_object,
    reap_leftovers,
)
from jetctl.client.spool import Outcome, PendingGroup, Spool
from jetctl.client.timeline import ChatRenderer
from jetctl.client.transport import (
    EndpointNotFound,
    RetryPolicy,
    ServerBackend,
    SwarmTransport,
)
from jetctl.env import Task
from jetctl.proto._gen import swarm_pb2 as pb
from jetctl.proto.convert import group_to_pb
from jetctl.recipe import TaskConfig
from jetctl.tls import TlsFiles
from jetctl.types import Trajectory, TrajectoryGroup, uuid7

log = logging.getLogger(__name__)

SILENT_S = 5.0  # a Submit unanswered this long marks the server unreachable in the status

ACK_OUTCOME: dict[int, Outcome] = {
    pb.Ack.ACCEPTED: "accepted",
    pb.Ack.DUPLICATE: "duplicate",
    pb.Ack.STALE: "stale",
    pb.Ack.INVALID: "invalid",
    pb.Ack.REVISION: "revision",
}


@dataclass
class NodeConfig:
    name: str
    task_name: str
    task: TaskConfig
    run_dir: Path
    token: str
    index: int = 0
    revision: str = "default"
    agent: str | None = None  # overrides task.agent
    max_groups: int | None = None  # stop after this many groups (tests, benchmarks)
    drain_grace_s: float = 30.0
    status_interval_s: float = 1.0
    metrics_port: int | None = 0  # None: no /metrics
    submit_batch_groups: int = 8
    resend_base_s: float = 0.5
    resend_max_s: float = 30.0
    probe_s: float = 2.0  # while Submit fails, resend the oldest group this often
    install_signal_handlers: bool = True
    endpoint: str | None = None  # fixed server endpoint instead of servers/<model>.json
    tls: TlsFiles | None = None  # run.tls; None: plaintext

    @property
    def agent_spec(self) -> str:
        return self.agent or self.task.agent


@dataclass
class NodeStats:
    rollouts_done: int = 0
    rollouts_failed: int = 0
    rollouts_timeout: int = 0
    groups_spooled: int = 0
    groups_dropped: int = 0
    groups_finished: int = 0
    acks: dict[str, int] = field(default_factory=dict)
    dropped: dict[str, int] = field(default_factory=dict)


class ClientNode:
    def __init__(self, config: NodeConfig) -> None:
        self.config = config
        # groups per Submit; drops to 1 after a whole request was refused, to isolate the bad one
        self._submit_batch = config.submit_batch_groups
        self.model = config.task.model
        self.state = "starting"
        self.stats = NodeStats()
        self.metrics = ClientMetrics()
        self.metrics_port: int | None = None
        self.spool = Spool(config.run_dir / "spool" / f"{config.name}.sqlite")
        # live rollouts (pid, start time): a restart kills what a killed predecessor left
        self._rollout_registry = config.run_dir / "spool" / f"{config.name}.rollouts"
        self.transport = SwarmTransport(
            self.model, config.token, run_dir=config.run_dir, endpoint=config.endpoint,
            tls=config.tls,
            # retries within a call stay short (<= 2 s apart): the spool retries for longer
            retry=RetryPolicy(max_s=2.0, total_s=30.0), call_timeout_s=15.0,
        )
        self.proxy: Proxy | None = None
        self.backend: Backend | None = None
        self.register_reply: pb.RegisterReply | None = None
        self._draining = asyncio.Event()
        self._sender_wake = asyncio.Event()
        self._stop_sender = asyncio.Event()
        self._semaphore = asyncio.Semaphore(config.task.concurrency)
        self._runner: RolloutRunner | None = None
        self.backpressure = False  # the spool is above spool_max_bytes: no new rollouts
        self._link_down_since: float | None = None  # monotonic; a Submit failed in transport
        self._last_probe = 0.0
        self._submit_since: float | None = None  # monotonic start of the Submit under way
        self._local_engine: Any = None

    # ------------------------------------------------------------------ lifecycle

    def drain(self) -> None:
        """Stop taking tasks; `run` then finishes in-flight work, flushes and returns."""
        if not self._draining.is_set():
            log.info("node %s draining", self.config.name)
            self._draining.set()
            if self.state in ("starting", "running", "backoff"):
                self.state = "draining"

    async def run(self) -> int:
        """The whole life of a node; returns the process exit code."""
        loop = asyncio.get_running_loop()
        if self.config.install_signal_handlers:
            for sig in (signal.SIGTERM, signal.SIGINT):
                loop.add_signal_handler(sig, self.drain)
        status_task = asyncio.create_task(self._status_loop())
        sender: asyncio.Task[None] | None = None
        try:
            if self.config.metrics_port is not None:
                self.metrics_port = self.metrics.serve("127.0.0.1", self.config.metrics_port)
            self._recover_lost()
            # Groups left by an earlier node of this name go out first.
            sender = asyncio.create_task(self._sender_loop())
            if not await self._register():
                return await self._finish(sender, status_task)
            await self._start_serving()
            self.state = "running" if not self._draining.is_set() else "draining"
            await self._produce()
            return await self._finish(sender, status_task)
        except BaseException:
            self.state = "exited"
            if sender is not None:
                sender.cancel()
            status_task.cancel()
            self._write_status()
            raise
        finally:
            await self._shutdown()

    def _recover_lost(self) -> None:
        """Rollouts an earlier process of this node left running (it was killed) are lost."""
        reaped = reap_leftovers(self._rollout_registry)
        if reaped:
            log.warning("killed %d rollout(s) an earlier process of %s left running",
                        reaped, self.config.name)
        lost = self.spool.recover_lost("the node died while this rollout ran (killed or crashed)")
        if lost:
            log.warning("%d rollouts of an earlier process of %s were lost", lost, self.config.name)
            self.stats.dropped["lost"] = self.stats.dropped.get("lost", 0) + lost
            self.metrics.dropped.labels(reason="lost").inc(lost)

    async def _finish(self, sender: asyncio.Task[None], status_task: asyncio.Task[None]) -> int:
        self.state = "draining"
        await self._flush(self.config.drain_grace_s)
        self._stop_sender.set()
        sender.cancel()  # a Submit still retrying is abandoned; its groups stay spooled
        try:
            await sender
        except asyncio.CancelledError:
            pass
        self.state = "exited"
        status_task.cancel()
        self._write_status()
        return 0

    async def _shutdown(self) -> None:
        if self.proxy is not None:
            await self.proxy.stop()
        if self._runner is not None:
            self._runner.shutdown()
        await self.transport.close()
        self.metrics.close()
        self.spool.close()

    async def _register(self) -> bool:
        """Register, retrying with backoff until the server answers (False if drained first)."""
        delay = 0.5
        while not self._draining.is_set():
            try:
                reply = await self.transport.register(
                    self.config.name, self.config.task_name, self.config.revision
                )
            except (grpc.aio.AioRpcError, EndpointNotFound) as e:
                self.state = "backoff"
                log.warning(
                    "register with %s failed (%s); retrying in %.1fs", self.model, _short(e), delay
                )
                await _sleep_or(self._draining, delay)
                delay = min(delay * 2, 10.0)
                continue
            # a plain revision, or `<task>/<revision>` (swap-clients --drop-old)
            mine = {self.config.revision, f"{self.config.task_name}/{self.config.revision}"}
            if mine & set(reply.refused_revisions):
                log.warning(
                    "server %s refuses revision %s; exiting", self.model, self.config.revision
                )
                self.drain()
                return False
            self.register_reply = reply
            return True
        return False

    async def _start_serving(self) -> None:
        reply = self.register_reply
        assert reply is not None
        from jetctl.models import tokenizer_from_files

        loop = asyncio.get_running_loop()
        tokenizer = await loop.run_in_executor(
            None, tokenizer_from_files, dict(reply.tokenizer_files)
        )
        if reply.chat_template:
            tokenizer.chat_template = reply.chat_template
        renderer = ChatRenderer(tokenizer, list(reply.eos_token_ids))
        if self.config.task.inference == "local":
            from jetctl.client.local_engine import LocalEngine

            engine = await LocalEngine.start(
                reply.model_source, self.transport, reply.model_version
            )
            self._local_engine = engine
            self.backend = engine
        else:
            self.backend = ServerBackend(self.transport)
        sampling = self.config.task.sampling
        self.proxy = Proxy(
            {
                self.model: ServedModel(
                    self.model, renderer, self.backend, int(reply.max_context_tokens) or 2048
                )
            },
            default_model=self.model,
            sampling=Sampling(sampling.temperature, sampling.top_p, sampling.max_tokens),
        )
        await self.proxy.start()
        env_module = self.config.task.env.partition(":")[0]
        agent_module = self.config.agent_spec.partition(":")[0]
        self._runner = RolloutRunner(
            [env_module, agent_module], max_workers=self.config.task.concurrency,
            registry=self._rollout_registry,
        )

    # ------------------------------------------------------------------ producing

    def _tasks(self) -> Iterator[Task]:
        make_env = load_object(self.config.task.env)
        env = make_env(**self.config.task.env_args)
        return iter(env.tasks(random.Random(self.config.task.seed + self.config.index)))

    async def _produce(self) -> None:
        cfg = self.config
        tasks = self._tasks()
        max_inflight = math.ceil(cfg.task.concurrency / cfg.task.group_size) + 1
        inflight: set[asyncio.Task[None]] = set()
        started = 0
        while not self._draining.is_set() and (cfg.max_groups is None or started < cfg.max_groups):
            self.backpressure = self.spool.bytes() > cfg.task.spool_max_bytes
            if self.backpressure or len(inflight) >= max_inflight:
                # back-pressure, or enough groups queued for the rollout slots
                if inflight:
                    await asyncio.wait(inflight, timeout=0.5, return_when=asyncio.FIRST_COMPLETED)
                    inflight = {t for t in inflight if not t.done()}
                else:
                    await _sleep_or(self._draining, 0.5)
                continue
            if self._local_engine is not None:
                self._local_engine.refresh()
            task = next(tasks, None)
            if task is None:
                log.info("the env's task stream ended after %d groups", started)
                break
            inflight.add(asyncio.create_task(self._run_group(task)))
            started += 1
        if inflight:
            await asyncio.gather(*inflight)

    async def _run_group(self, task: Task) -> None:
        group_id = uuid7()
        trajectory_ids = [uuid7() for _ in range(self.config.task.group_size)]
        # made and recorded before anything is sent: if the node dies now, they are lost
        self.spool.start(group_id, trajectory_ids)
        trajectories = await asyncio.gather(
            *(self._run_rollout(task, group_id, tid) for tid in trajectory_ids)
        )
        ok = [t for t in trajectories if t.status == "ok"]
        for t in trajectories:
            if t.status != "ok":
                self._record_drop(t.id, t.status, t.error)
        if len(ok) < 2:
            reason = (
                f"group {group_id} dropped: {len(ok)} of {len(trajectories)} rollouts ok (need 2)"
            )
            for t in ok:
                self._record_drop(t.id, "failed", reason)
            self.stats.groups_dropped += 1
            log.warning("%s", reason)
        else:
            group = TrajectoryGroup(
                id=group_id,
                task=self.config.task_name,
                task_id=task.id,
                model=self.model,
                trajectories=ok,
            )
            self.spool.put(
                group.id, group_to_pb(group).SerializeToString(), len(ok),
                trajectory_ids=[t.id for t in ok],
            )
            self.stats.groups_spooled += 1
            self._sender_wake.set()
        self.stats.groups_finished += 1

    async def _run_rollout(self, task: Task, group_id: str, trajectory_id: str) -> Trajectory:
        assert self.proxy is not None and self._runner is not None
        cfg = self.config
        async with self._semaphore:
            self.proxy.open(trajectory_id)
            spec = RolloutSpec(
                env=cfg.task.env,
                env_args=dict(cfg.task.env_args),
                agent=cfg.agent_spec,
                task=task,
                base_url=self.proxy.base_url(trajectory_id),
                model=self.model,
            )
            try:
                result = await self._runner.run(spec, cfg.task.rollout_timeout_s)
            finally:
                timeline = self.proxy.close(trajectory_id)
        calls = [c for c in timeline.calls if c.model == self.model]
        if result.status == "ok" and not calls:
            result = RolloutResult(
                status="failed",
                reward=result.reward,
                error="the agent returned without calling the model (nothing to train on)",
                error_type="NoLLMCalls",
                timings=result.timings,
            )
        self._count_rollout(result)
        metadata = {"reused_prompts": str(sum(t.reused for t in timeline.turns))}
        if result.error_type:
            metadata["error_type"] = result.error_type
        return Trajectory(
            id=trajectory_id,
            group_id=group_id,
            task=cfg.task_name,
            task_id=task.id,
            client_id=cfg.name,
            client_revision=cfg.revision,
            role="default",
            calls=calls,
            reward=result.reward,
            status=result.status,  # type: ignore[arg-type]  # ok | failed | timeout by construction
            error=result.error,
            timings=dict(result.timings),
            metadata=metadata,
        )

    def _count_rollout(self, result: RolloutResult) -> None:
        if result.status == "ok":
            self.stats.rollouts_done += 1
        elif result.status == "timeout":
            self.stats.rollouts_timeout += 1
        else:
            self.stats.rollouts_failed += 1
        self.metrics.rollouts.labels(task=self.config.task_name, outcome=result.status).inc()
        self.metrics.rollout_duration.observe(result.timings.get("rollout_s", 0.0))

    def _record_drop(self, trajectory_id: str, reason: str, error: str) -> None:
        self.spool.drop(trajectory_id, reason, error)  # type: ignore[arg-type]  # timeout | failed
        self.stats.dropped[reason] = self.stats.dropped.get(reason, 0) + 1
        self.metrics.dropped.labels(reason=reason).inc()

    # ------------------------------------------------------------------ sending

    async def _sender_loop(self) -> None:
        while not self._stop_sender.is_set():
            sent = await self._send_once()
            if sent:
                continue
            if self._probe_due():
                continue
            next_due = self.spool.next_due_at()
            wait = 1.0 if next_due is None else min(1.0, max(0.02, next_due - time.time()))
            self._sender_wake.clear()
            try:
                await asyncio.wait_for(self._sender_wake.wait(), timeout=wait)
            except asyncio.TimeoutError:
                pass

    async def _send_once(self) -> int:
        """Push one batch of due groups; returns how many were attempted."""
        due = self.spool.due(limit=self._submit_batch)
        if not due:
            return 0
        limit = self.transport.max_message_bytes
        cap = limit - min(4096, limit // 10)  # room for the request's framing
        batch: list[PendingGroup] = []
        size = 0
        for item in due:
            if len(item.payload) > cap:
                group = pb.TrajectoryGroup.FromString(item.payload)
                error = f"group is {len(item.payload)} bytes; the server takes at most {cap}"
                self.spool.dead_letter(item.id, [t.id for t in group.trajectories], error)
                self.stats.dropped["dead-letter"] = self.stats.dropped.get("dead-letter", 0) + len(
                    group.trajectories
                )
                self.metrics.dropped.labels(reason="dead-letter").inc(len(group.trajectories))
                continue
            if batch and size + len(item.payload) > cap:
                break
            batch.append(item)
            size += len(item.payload)
        if not batch:
            return len(due)
        try:
            reply = await self._timed_submit(
                [pb.TrajectoryGroup.FromString(i.payload) for i in batch]
            )
        except (grpc.aio.AioRpcError, EndpointNotFound) as e:
            if isinstance(e, grpc.aio.AioRpcError) and e.code() == grpc.StatusCode.INVALID_ARGUMENT:
                # the server refused the request whole: every group in it is invalid. With
                # several groups, resend them one by one next time to tell which.
                if len(batch) == 1:
                    self._record_ack(batch[0], "invalid", f"invalid: {e.details()}")
                else:
                    self._submit_batch = 1
                    for item in batch:
                        self.spool.defer(item.id, 0.0)
                return len(batch)
            log.warning("submit of %d groups failed: %s; will resend", len(batch), _short(e))
            for item in batch:
                self.spool.defer(item.id, self._resend_delay(item.attempts))
            if self._link_down_since is None:
                self._link_down_since = time.monotonic()
            return len(batch)
        if self._link_down_since is not None:
            # the link is back: everything deferred goes now, not after its backoff
            resent = self.spool.retry_now()
            log.info(
                "server reachable again after %.1fs; resending %d deferred groups now",
                time.monotonic() - self._link_down_since, resent,
            )
            self._link_down_since = None
        acks = {a.group_id: a for a in reply.acks}
        for item in batch:
            ack = acks.get(item.id)
            outcome = ACK_OUTCOME.get(ack.code) if ack is not None else None
            if ack is None or outcome is None:
                self.spool.defer(item.id, self._resend_delay(item.attempts))
                continue
            self._record_ack(item, outcome, ack.reason)
        return len(batch)

    async def _timed_submit(self, groups: list[pb.TrajectoryGroup]) -> pb.SubmitReply:
        """`transport.submit`, noting when it started (the status's liveness check)."""
        self._submit_since = time.monotonic()
        try:
            return await self.transport.submit(groups)
        finally:
            self._submit_since = None

    def _record_ack(self, item: PendingGroup, outcome: Outcome, reason: str) -> None:
        self.spool.ack(item.id, outcome, reason)
        self.stats.acks[outcome] = self.stats.acks.get(outcome, 0) + 1
        if outcome in ("stale", "invalid", "revision"):
            log.warning("group %s %s: %s", item.id, outcome, reason)
        if outcome == "revision":
            self.drain()  # the server refuses this revision: nothing more to do here

    def _probe_due(self) -> bool:
        """While the link is down, send the oldest deferred group every `probe_s` (a probe):
        the first one that gets through makes everything else due at once."""
        if self._link_down_since is None:
            return False
        now = time.monotonic()
        if now - self._last_probe < self.config.probe_s:
            return False
        self._last_probe = now
        return self.spool.retry_now(limit=1) > 0

    def _resend_delay(self, attempts: int) -> float:
        cap = min(self.config.resend_max_s, self.config.resend_base_s * 2**attempts)
        return random.uniform(cap / 2, cap)

    async def _flush(self, grace_s: float) -> None:
        """Wait until the spool is empty or `grace_s` is up (un-acked groups stay spooled)."""
        deadline = time.monotonic() + grace_s
        while self.spool.depth() > 0 and time.monotonic() < deadline:
            self._sender_wake.set()
            await asyncio.sleep(0.05)
        if self.spool.depth() > 0:
            log.warning(
                "drain: %d groups still un-acked; they stay in %s",
                self.spool.depth(),
                self.spool.path,
            )

    # ------------------------------------------------------------------ status

    async def _status_loop(self) -> None:
        while True:
            self._write_status()
            await asyncio.sleep(self.config.status_interval_s)

    def status(self) -> dict[str, Any]:
        # a Submit unanswered for SILENT_S is a dead link even before its deadline (a
        # blackholed connection: nothing is refused, gRPC keepalive may take longer)
        silent = self._submit_since is not None and (
            time.monotonic() - self._submit_since > SILENT_S
        )
        reachable = self.transport.reachable and not silent
        self.metrics.server_reachable.set(1 if reachable else 0)
        depth = self.spool.depth()
        self.metrics.spool_groups.set(depth)
        self.metrics.spool_oldest_age.set(self.spool.oldest_age_s())
        return {
            "name": self.config.name,
            "task": self.config.task_name,
            "model": self.model,
            "state": self.state,
            "revision": self.config.revision,
            "rollouts_done": self.stats.rollouts_done,
            "rollouts_failed": self.stats.rollouts_failed,
            "rollouts_timeout": self.stats.rollouts_timeout,
            "groups_spooled": self.stats.groups_spooled,
            "spool_depth": depth,
            "spool_bytes": self.spool.bytes(),
            "backpressure": self.backpressure,
            "server_reachable": reachable,
            "acks": dict(self.stats.acks),
            "dropped": dict(self.stats.dropped),
            "pid": os.getpid(),
            "updated_at": time.time(),
            "metrics": f"127.0.0.1:{self.metrics_port}" if self.metrics_port else None,
            "proxy": f"127.0.0.1:{self.proxy.port}"
            if self.proxy is not None and self.proxy.port
            else None,
        }

    def _write_status(self) -> None:
        path = self.config.run_dir / "nodes" / f"{self.config.name}.json"
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_suffix(f".json.tmp{os.getpid()}")
        tmp.write_text(json.dumps(self.status(), indent=1))
        os.replace(tmp, path)


async def _sleep_or(event: asyncio.Event, seconds: float) -> None:
    try:
        await asyncio.wait_for(event.wait(), timeout=seconds)
    except asyncio.TimeoutError:
        pass


def _short(e: BaseException) -> str:
    if isinstance(e, grpc.aio.AioRpcError):
        return f"{e.code().name}: {e.details()}"
    return f"{type(e).__name__}: {e}"
