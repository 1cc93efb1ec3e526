"""Rollout production: tasks in, rollouts run, GRPO groups spooled.

    producer = Producer(ProductionConfig(...), proxy, runner, spool, stats, metrics,
                        draining=node_draining_event, on_spooled=delivery.wake)
    await producer.run()    # until drained, max_groups reached or the task stream ends

Tasks come from `make_env(**env_args).tasks(random.Random(seed + index))`, or, for a dataset
env on a node with a controller, from rows leased from the run (jetctl.client.rows: each row
once per epoch across the task's nodes, acked as its group ends); for each one
`group_size` rollouts run concurrently (at most `concurrency` at once on the node, a number or
sized by the server's load with `auto`, see concurrency.py; each in a
killable process, see rollout.py) and the ok ones become a `TrajectoryGroup`. Trajectory ids
are recorded in the spool before their rollouts start (so a killed node's are found
`dropped(lost)`). Failed and timed-out trajectories are recorded in the spool's `dropped`
table with their error; a group with fewer than 2 ok trajectories is dropped whole (GRPO needs
a comparison). Rollouts never wait for training; they wait only while the spool holds more
than `spool_max_bytes` (back-pressure; nothing un-acked is ever deleted).

The costs of the trajectories dropped here (failed, timed out, or ok in a dropped group) are
tallied in `Producer.waste` (jetctl/costs.py `NodeWaste`, shared with the node's deliveries,
which add the groups the server refuses), which the node's status reports: spend that
trained nothing. Each rollout's `Reported` (jetctl/client/rollout.py) holds what it reported
as it ran, so a timed-out rollout's spend counts, and so does a lost group's.

Every finished group's outcome is read. A group whose task raised (e.g. its rollout process
could not start because the node's forkserver died under a SIGTERM) is logged with its
traceback, counted (`jetctl_client_group_errors_total`), and its trajectories still in
progress become `dropped(failed)` with that error at once, in one transaction: a node that
drains leaves nothing in `inflight`, so the ledger balances without a restart. They are
waste too, each with what its rollout reported before the group was lost (its result, or
the spend and env seconds so far of one stopped with the group; nothing of one that never
started).

A team task (`roles:`) splits each rollout's timeline by role: each role's calls become that
role's trajectory (ids of its own, made before the rollouts start, with the rollout's id in
`metadata["rollout_id"]`), and each role's trajectories of the group become a group for that
role's model, with the role's reward (`session.reward()` may return one per role; else every
role gets the shared one). A role's group stands or falls alone (fewer than 2 ok: dropped),
and the groups of one batch of rollouts are spooled in one transaction.

`run.deterministic: true` (`deterministic_run` set; jetctl.deterministic): each rollout's
requests are seeded from the run, the node, the group's ordinal on the node and the
rollout's place in it (recorded on each trajectory as `metadata["seeded_at"]`:
"group/trajectory"), and a dataset env's rows come from its own seeded `tasks(rng)`, not
from leases.
"""

from __future__ import annotations

import asyncio
import functools
import logging
import math
import random
import traceback
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from jetctl import tracing
from jetctl.client.concurrency import Governor, Slots
from jetctl.client.metrics import ClientMetrics, NodeStats
from jetctl.client.proxy import Proxy
from jetctl.client.rollout import (
    Reported,
    RolloutResult,
    RolloutRunner,
    RolloutSpec,
    load_object,
)
from jetctl.client.rows import Picked, TaskSource, task_source
from jetctl.client.spool import Spool, SpooledGroup
from jetctl.costs import NodeWaste, rollout_costs
from jetctl.deterministic import RolloutSeeds
from jetctl.env import Task
from jetctl.link import ControlLink
from jetctl.proto.convert import group_to_pb
from jetctl.recipe import TaskConfig
from jetctl.types import LLMCall, Trajectory, TrajectoryGroup, uuid7

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class ProductionConfig:
    node: str  # client_id on every trajectory
    task_name: str
    task: TaskConfig
    agent: str  # module:function
    revision: str
    index: int = 0  # seeds the task stream
    deterministic_run: str | None = None  # run.deterministic: the run's name; None: off
    max_groups: int | None = None  # stop after this many groups (tests, benchmarks)


@dataclass(frozen=True)
class _Part:
    """One role's share of a group of rollouts: bound for that role's model."""

    role: str
    model: str
    group_id: str
    trajectory_ids: list[str]  # one per rollout, in rollout order


@dataclass(frozen=True)
class _Group:
    """One task's group of rollouts, its ids recorded in the spool before it starts."""

    task: Task
    rollout_ids: list[str]
    parts: list[_Part]  # one per role (one for a task without roles)
    ordinal: int  # the group's place among the node's groups (0, 1, ...): seeds its calls
    reported: list[Reported]  # what each rollout reported so far (its result once it ends)
    wasted: set[str] = field(default_factory=set)  # trajectory ids already in the waste tally


@dataclass(frozen=True)
class _Rollout:
    """What one rollout left: its result and its calls by role."""

    result: RolloutResult
    calls: dict[str, list[LLMCall]]  # role -> that role's calls
    metadata: dict[str, str]


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
        governor: Governor | None = None,  # concurrency: auto
        link: ControlLink | None = None,  # a dataset env's rows are leased from the run
        waste: NodeWaste | None = None,  # the node's tally (None: one of its own, in memory)
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
        self.governor = governor
        self.slots = Slots(governor.limit if governor is not None else int(config.task.concurrency))
        self._roles = config.task.role_models  # role -> model
        self._team = bool(config.task.roles)
        self._link = link
        # the costs of this node's trajectories that never reached a spooled group (failed,
        # timed out, ok in a dropped group, or lost with a group whose task raised): its
        # status's `waste` (jetctl/costs.py)
        self.waste = waste if waste is not None else NodeWaste(roles=len(self._roles))

    def _tasks(self) -> TaskSource:
        """The env's tasks: rows leased from the controller for a dataset env on a node
        with one (jetctl.client.rows), else the env's own `tasks(rng)`."""
        cfg = self.config
        make_env = load_object(cfg.task.env)
        env = make_env(**cfg.task.env_args)
        return task_source(
            env, self._link, node=cfg.node, task=cfg.task_name,
            rng=random.Random(cfg.task.seed + cfg.index),
            block=math.ceil(self.slots.limit / cfg.task.group_size) + 1, stop=self._draining,
            leased=cfg.deterministic_run is None,  # deterministic: rows in the seeded order
        )

    async def run(self) -> None:
        cfg = self.config
        tasks = self._tasks()
        inflight: dict[asyncio.Task[None], _Group] = {}
        started = 0
        while not self._draining.is_set() and (cfg.max_groups is None or started < cfg.max_groups):
            await self._steer()
            # enough groups queued for the rollout slots, and one more ready to start
            max_inflight = math.ceil(self.slots.limit / cfg.task.group_size) + 1
            # what the groups in flight will add counts: they cannot carry it past the mark
            self.backpressure = self.spool.committed_bytes() > cfg.task.spool_max_bytes
            if self.backpressure or len(inflight) >= max_inflight:
                # back-pressure, or enough groups queued for the rollout slots
                if inflight:
                    done, _ = await asyncio.wait(
                        inflight, timeout=0.5, return_when=asyncio.FIRST_COMPLETED
                    )
                    for finished in done:
                        self._settle(finished, inflight.pop(finished))
                else:
                    await sleep_or(self._draining, 0.5)
                continue
            if self._local_engine is not None:
                self._local_engine.refresh()
            picked = await tasks.next()
            if picked is None:
                log.info("the env's task stream ended after %d groups", started)
                break
            group = self._start_group(picked.task, started)
            job = asyncio.create_task(self._run_group(group))
            job.add_done_callback(functools.partial(_row_done, tasks, picked))
            inflight[job] = group
            started += 1
        if inflight:
            await asyncio.wait(inflight)
            for finished, group in inflight.items():
                self._settle(finished, group)
        await tasks.close()

    async def _steer(self) -> None:
        """concurrency: auto: the governor's new limit, when it has one."""
        if self.governor is None:
            return
        decision = self.governor.decide(self.slots.peak())
        if decision is not None and decision.limit != self.slots.limit:
            await self.slots.resize(decision.limit)
            self.metrics.concurrency.set(decision.limit)
            log.info("concurrency %d: %s", decision.limit, decision.why)

    def _start_group(self, task: Task, ordinal: int) -> _Group:
        """The ids of a task's group: each role's part of the rollouts becomes a group for
        that role's model (a task without roles: one part, whose ids are the rollouts'),
        recorded in the spool before anything runs: if the node dies now, they are lost."""
        rollout_ids = [uuid7() for _ in range(self.config.task.group_size)]
        parts = [
            _Part(role, model, uuid7(), list(rollout_ids) if not self._team else
                  [uuid7() for _ in rollout_ids])
            for role, model in self._roles.items()
        ]
        for part in parts:
            self.spool.start(part.group_id, part.trajectory_ids, model=part.model)
        return _Group(task, rollout_ids, parts, ordinal, [Reported() for _ in rollout_ids])

    def _settle(self, finished: asyncio.Task[None], group: _Group) -> None:
        """Read a finished group task's outcome. On an error it is logged with its cause and
        counted, and the group's trajectories still in progress become dropped(failed) with
        it, so none stays `inflight`, and to the waste tally with what their rollouts
        reported."""
        exc = None if finished.cancelled() else finished.exception()
        if exc is None and not finished.cancelled():
            return
        error = (
            "".join(traceback.format_exception(exc)) if exc is not None
            else "the group's task was cancelled before its rollouts finished"
        )
        self.metrics.group_errors.inc()
        self.stats.groups_dropped += 1
        dropped = 0
        lost: list[Reported] = []  # the rollout of each trajectory dropped here
        for part in group.parts:
            n = self.spool.drop_group(
                part.group_id, "failed", f"the node's group task failed: {error}"
            )
            self.stats.drop("failed", n)
            self.metrics.dropped.labels(reason="failed").inc(n)
            dropped += n
            # those still in progress: not yet tallied (a group that failed after some of its
            # trajectories were dropped has tallied those)
            lost += [r for tid, r in zip(part.trajectory_ids, group.reported)
                     if tid not in group.wasted][:n]
        roles = len(self._roles)
        self.waste.add((rollout_costs(r.timings, r.usd, roles), r.timings.get("rollout_s"))
                       for r in lost)
        log.error(
            "group %s of task %s failed (%s); its %d trajectories in progress are recorded as "
            "dropped(failed)", group.parts[0].group_id, self.config.task_name,
            f"{type(exc).__name__}: {exc}" if exc is not None else "cancelled", dropped,
            exc_info=exc,
        )

    async def _run_group(self, group: _Group) -> None:
        """`group_size` rollouts of one task, spooled as one group per part (role)."""
        task, rollout_ids, parts = group.task, group.rollout_ids, group.parts
        runs = [
            asyncio.create_task(self._run_rollout(
                task, rid, self._seeds(group.ordinal, i), group.reported[i]))
            for i, rid in enumerate(rollout_ids)
        ]
        try:
            rollouts = await asyncio.gather(*runs)
        except BaseException:
            for run in runs:  # the group is lost as a whole: stop (and kill) its other rollouts
                run.cancel()
            await asyncio.wait(runs)  # stopped: what each spent so far is in its Reported
            raise
        spooled = []
        for part in parts:
            made = self._part_group(group, part, rollouts)
            if made is not None:
                spooled.append(SpooledGroup(
                    made.id, group_to_pb(made).SerializeToString(),
                    [t.id for t in made.trajectories], part.model,
                ))
        if spooled:
            self.spool.put_all(spooled)
            self.stats.groups_spooled += len(spooled)
            self._on_spooled()
        self.stats.groups_finished += 1

    def _part_group(
        self, group: _Group, part: _Part, rollouts: list[_Rollout]
    ) -> TrajectoryGroup | None:
        """The group of one role, or None when fewer than 2 of its trajectories are ok (its
        trajectories are then recorded as dropped)."""
        task = group.task
        trajectories = [
            self._trajectory(task, part, rid, tid, r)
            for rid, tid, r in zip(group.rollout_ids, part.trajectory_ids, rollouts)
        ]
        failed = [t for t in trajectories if t.status != "ok"]
        for t in failed:
            self._record_drop(t.id, t.status, t.error, part.model)
        ok = [t for t in trajectories if t.status == "ok"]
        if len(ok) >= 2:
            self._waste(group, failed)
            return TrajectoryGroup(
                id=part.group_id, task=self.config.task_name, task_id=task.id, model=part.model,
                trajectories=ok,
            )
        role = f" of role {part.role}" if self._team else ""
        reason = (
            f"group {part.group_id}{role} dropped: {len(ok)} of {len(trajectories)} rollouts ok "
            "(need 2)"
        )
        for t in ok:
            self._record_drop(t.id, "failed", reason, part.model)
        self._waste(group, failed + ok)
        self.stats.groups_dropped += 1
        log.warning("%s", reason)
        return None

    def _trajectory(
        self, task: Task, part: _Part, rollout_id: str, trajectory_id: str, rollout: _Rollout
    ) -> Trajectory:
        """One role's trajectory of one rollout: that role's calls, with the role's reward."""
        cfg = self.config
        result = rollout.result
        status, error = result.status, result.error
        calls = rollout.calls.get(part.role, [])
        reward = result.reward
        metadata = dict(rollout.metadata)
        if result.error_type:
            metadata["error_type"] = result.error_type
        if self._team:
            metadata["rollout_id"] = rollout_id  # the team's other parts carry it too
        if status == "ok" and result.role_rewards:
            unknown = sorted(set(result.role_rewards) - set(self._roles))
            if unknown:
                status, error = "failed", (
                    f"the env's reward() named role {unknown[0]!r}, which task "
                    f"{cfg.task_name} does not have (roles: {', '.join(self._roles)})"
                )
                metadata["error_type"] = "UnknownRole"
            elif part.role in result.role_rewards:
                reward = result.role_rewards[part.role]
            elif calls:
                status, error = "failed", (
                    f"the env's reward() gave rewards for {', '.join(sorted(result.role_rewards))}"
                    f" but not for role {part.role!r}, which made calls: score every role"
                )
                metadata["error_type"] = "MissingRoleReward"
        if status == "ok" and not calls:  # a team rollout in which this role never spoke
            status = "failed"
            error = f"the agent never called role {part.role!r} in this rollout"
            metadata["error_type"] = "NoLLMCalls"
        return Trajectory(
            id=trajectory_id,
            group_id=part.group_id,
            task=cfg.task_name,
            task_id=task.id,
            client_id=cfg.node,
            client_revision=cfg.revision,
            role=part.role,
            calls=calls,
            reward=reward,
            status=status,  # type: ignore[arg-type]  # ok | failed | timeout by construction
            error=error,
            timings=dict(result.timings),
            metadata=metadata,
            costs=rollout_costs(result.timings, result.usd, roles=len(self._roles)),
        )

    def _waste(self, group: _Group, trajectories: list[Trajectory]) -> None:
        """Trajectories that train nothing: their costs (each its share of its rollout's) go
        to the node's waste tally, with their share of their rollouts' wall seconds."""
        group.wasted.update(t.id for t in trajectories)
        self.waste.add((t.costs, t.timings.get("rollout_s", 0.0)) for t in trajectories)

    def _seeds(self, group: int, trajectory: int) -> RolloutSeeds | None:
        """The seeds of a rollout's calls in a deterministic run (None: unseeded)."""
        run = self.config.deterministic_run
        return None if run is None else RolloutSeeds(run, self.config.node, group, trajectory)

    async def _run_rollout(
        self, task: Task, rollout_id: str, seeds: RolloutSeeds | None, reported: Reported
    ) -> _Rollout:
        cfg = self.config
        async with self.slots:
            self.proxy.open(rollout_id, seeds)
            roles = tuple(self._roles) if self._team else ()
            spec = RolloutSpec(
                env=cfg.task.env,
                env_args=dict(cfg.task.env_args),
                agent=cfg.agent,
                task=task,
                base_url=self.proxy.base_url(rollout_id),
                traceparent=tracing.traceparent(rollout_id),
                model=roles[0] if roles else next(iter(self._roles.values())),
                roles=roles,
            )
            try:
                # calls held for a server still starting do not count against the timeout
                result = await self.runner.run(spec, cfg.task.rollout_timeout_s, reported,
                                               held=self.proxy.held_s)
            finally:
                timeline = self.proxy.close(rollout_id)
        calls = {role: timeline.calls_of(role) for role in self._roles}
        if result.status == "ok" and not any(calls.values()):
            result = RolloutResult(
                status="failed",
                reward=result.reward,
                error="the agent returned without calling the model (nothing to train on)",
                error_type="NoLLMCalls",
                timings=result.timings,
                usd=result.usd,  # what its session spent is spent all the same
            )
        reported.update(result.usd, result.timings)  # its final figures, whatever the runner
        self._count_rollout(result)
        metadata = {"reused_prompts": str(sum(t.reused for t in timeline.turns)),
                    **tracing.carrier(rollout_id)}  # the trajectory's rollout span
        if seeds is not None:
            metadata["seeded_at"] = f"{seeds.group}/{seeds.trajectory}"
        return _Rollout(result, calls, metadata)

    def _count_rollout(self, result: RolloutResult) -> None:
        if result.status == "ok":
            self.stats.rollouts_done += 1
        elif result.status == "timeout":
            self.stats.rollouts_timeout += 1
        else:
            self.stats.rollouts_failed += 1
        self.metrics.rollouts.labels(task=self.config.task_name, outcome=result.status).inc()
        self.metrics.rollout_duration.observe(result.timings.get("rollout_s", 0.0))

    def _record_drop(self, trajectory_id: str, reason: str, error: str, model: str) -> None:
        # reason is timeout | failed by construction
        self.spool.drop(trajectory_id, reason, error, model=model)  # type: ignore[arg-type]
        self.stats.drop(reason)
        self.metrics.dropped.labels(reason=reason).inc()


def _row_done(tasks: TaskSource, picked: Picked, job: asyncio.Task[None]) -> None:
    """A group ended (spooled or dropped): its row was seen, and is acked now rather than when
    the loop settles the group, so that a node killed meanwhile is not leased it again. A
    group cancelled before it ended gives its row back."""
    tasks.done(picked, seen=not job.cancelled())


async def sleep_or(event: asyncio.Event, seconds: float) -> None:
    """Sleep `seconds`, or less when `event` is set meanwhile."""
    try:
        await asyncio.wait_for(event.wait(), timeout=seconds)
    except asyncio.TimeoutError:
        pass
