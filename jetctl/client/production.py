"""Rollout production: tasks in, rollouts run, GRPO groups spooled.

    producer = Producer(ProductionConfig(...), proxy, runner, spool, stats, metrics,
                        draining=node_draining_event, on_spooled=delivery.wake)
    await producer.run()    # until drained, max_groups reached or the task stream ends

Tasks come from `make_env(**env_args).tasks(random.Random(seed + index))`; for each one
`group_size` rollouts run concurrently (at most `concurrency` at once on the node, each in a
killable process, see rollout.py) and the ok ones become a `TrajectoryGroup`. Trajectory ids
are recorded in the spool before their rollouts start (so a killed node's are found
`dropped(lost)`). Failed and timed-out trajectories are recorded in the spool's `dropped`
table with their error; a group with fewer than 2 ok trajectories is dropped whole (GRPO needs
a comparison). Rollouts never wait for training; they wait only while the spool holds more
than `spool_max_bytes` (back-pressure; nothing un-acked is ever deleted).
"""

from __future__ import annotations

import asyncio
import logging
import math
import random
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

from jetctl.client.metrics import ClientMetrics, NodeStats
from jetctl.client.proxy import Proxy
from jetctl.client.rollout import RolloutResult, RolloutRunner, RolloutSpec, load_object
from jetctl.client.spool import Spool
from jetctl.env import Task
from jetctl.proto.convert import group_to_pb
from jetctl.recipe import TaskConfig
from jetctl.types import Trajectory, TrajectoryGroup, uuid7

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class ProductionConfig:
    node: str  # client_id on every trajectory
    task_name: str
    task: TaskConfig
    model: str
    agent: str  # module:function
    revision: str
    index: int = 0  # seeds the task stream
    max_groups: int | None = None  # stop after this many groups (tests, benchmarks)


class Producer:
    """Runs the agent on the env's tasks and spools the groups."""

    def __init__(
        self,
        config: ProductionConfig,
        proxy: Proxy,
        runner: RolloutRunner,
        spool: Spool,
        stats: NodeStats,
        metrics: ClientMetrics,
        *,
        draining: asyncio.Event,
        on_spooled: Callable[[], None],
        local_engine: Any = None,  # inference: local; refreshed between groups
    ) -> None:
        self.config = config
        self.proxy = proxy
        self.runner = runner
        self.spool = spool
        self.stats = stats
        self.metrics = metrics
        self.backpressure = False  # the spool is above spool_max_bytes: no new rollouts
        self._draining = draining
        self._on_spooled = on_spooled
        self._local_engine = local_engine
        self._semaphore = asyncio.Semaphore(config.task.concurrency)

    def _tasks(self) -> Iterator[Task]:
        task = self.config.task
        make_env = load_object(task.env)
        env = make_env(**task.env_args)
        return iter(env.tasks(random.Random(task.seed + self.config.index)))

    async def run(self) -> None:
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
                    await sleep_or(self._draining, 0.5)
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
        cfg = self.config
        group_id = uuid7()
        trajectory_ids = [uuid7() for _ in range(cfg.task.group_size)]
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
                task=cfg.task_name,
                task_id=task.id,
                model=cfg.model,
                trajectories=ok,
            )
            self.spool.put(
                group.id, group_to_pb(group).SerializeToString(), len(ok),
                trajectory_ids=[t.id for t in ok],
            )
            self.stats.groups_spooled += 1
            self._on_spooled()
        self.stats.groups_finished += 1

    async def _run_rollout(self, task: Task, group_id: str, trajectory_id: str) -> Trajectory:
        cfg = self.config
        async with self._semaphore:
            self.proxy.open(trajectory_id)
            spec = RolloutSpec(
                env=cfg.task.env,
                env_args=dict(cfg.task.env_args),
                agent=cfg.agent,
                task=task,
                base_url=self.proxy.base_url(trajectory_id),
                model=cfg.model,
            )
            try:
                result = await self.runner.run(spec, cfg.task.rollout_timeout_s)
            finally:
                timeline = self.proxy.close(trajectory_id)
        calls = [c for c in timeline.calls if c.model == cfg.model]
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
            client_id=cfg.node,
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
        self.stats.drop(reason)
        self.metrics.dropped.labels(reason=reason).inc()


async def sleep_or(event: asyncio.Event, seconds: float) -> None:
    """Sleep `seconds`, or less when `event` is set meanwhile."""
    try:
        await asyncio.wait_for(event.wait(), timeout=seconds)
    except asyncio.TimeoutError:
        pass
