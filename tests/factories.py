"""Factories of small test objects (trajectory groups)."""

from __future__ import annotations

import os

from jetctl.types import LLMCall, Trajectory, TrajectoryGroup, uuid7

# a CI tier must fail, not skip, when its component is missing
IN_CI = os.environ.get("CI") == "true"


def make_group(
    model: str = "policy",
    rewards: tuple[float, ...] = (0.0, 1.0),
    version: int = 0,
    prompt: tuple[int, ...] = (1, 2, 3),
    completion: tuple[int, ...] = (4, 5),
    task: str = "digits",
) -> TrajectoryGroup:
    gid = uuid7()
    trajs = [
        Trajectory(
            id=uuid7(),
            group_id=gid,
            task=task,
            task_id="t0",
            client_id="test",
            client_revision="r0",
            calls=[
                LLMCall(
                    model=model,
                    prompt_ids=list(prompt),
                    completion_ids=list(completion),
                    completion_logprobs=[-1.0] * len(completion),
                    model_version=version,
                )
            ],
            reward=r,
        )
        for r in rewards
    ]
    return TrajectoryGroup(id=gid, task=task, task_id="t0", model=model, trajectories=trajs)
