"""Map jetctl.types dataclasses to and from swarm.proto messages."""

from __future__ import annotations

from jetctl.proto._gen import swarm_pb2 as pb
from jetctl.types import LLMCall, Trajectory, TrajectoryGroup


def call_to_pb(c: LLMCall) -> pb.LLMCall:
    return pb.LLMCall(
        model=c.model,
        prompt_ids=c.prompt_ids,
        completion_ids=c.completion_ids,
        completion_logprobs=c.completion_logprobs,
        model_version=c.model_version,
        finish_reason=c.finish_reason,
    )


def call_from_pb(m: pb.LLMCall) -> LLMCall:
    return LLMCall(
        model=m.model,
        prompt_ids=list(m.prompt_ids),
        completion_ids=list(m.completion_ids),
        completion_logprobs=list(m.completion_logprobs),
        model_version=m.model_version,
        finish_reason=m.finish_reason,
    )


def trajectory_to_pb(t: Trajectory) -> pb.Trajectory:
    return pb.Trajectory(
        id=t.id,
        group_id=t.group_id,
        task=t.task,
        task_id=t.task_id,
        client_id=t.client_id,
        client_revision=t.client_revision,
        role=t.role,
        calls=[call_to_pb(c) for c in t.calls],
        reward=t.reward,
        status=t.status,
        error=t.error,
        timings=t.timings,
        metadata=t.metadata,
    )


def trajectory_from_pb(m: pb.Trajectory) -> Trajectory:
    return Trajectory(
        id=m.id,
        group_id=m.group_id,
        task=m.task,
        task_id=m.task_id,
        client_id=m.client_id,
        client_revision=m.client_revision,
        role=m.role,
        calls=[call_from_pb(c) for c in m.calls],
        reward=m.reward,
        status=m.status,  # type: ignore[arg-type]  # validated by the server's store
        error=m.error,
        timings=dict(m.timings),
        metadata=dict(m.metadata),
    )


def group_to_pb(g: TrajectoryGroup) -> pb.TrajectoryGroup:
    return pb.TrajectoryGroup(
        id=g.id,
        task=g.task,
        task_id=g.task_id,
        model=g.model,
        trajectories=[trajectory_to_pb(t) for t in g.trajectories],
    )


def group_from_pb(m: pb.TrajectoryGroup) -> TrajectoryGroup:
    return TrajectoryGroup(
        id=m.id,
        task=m.task,
        task_id=m.task_id,
        model=m.model,
        trajectories=[trajectory_from_pb(t) for t in m.trajectories],
    )
