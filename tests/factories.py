"""Factories of small test objects (trajectory groups, parsed recipes)."""

from __future__ import annotations

import os
from typing import Any

import yaml

from jetctl.recipe import Recipe, parse_recipe
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


# the smallest valid recipe: one tiny model, one digits task
GOOD_RECIPE: dict[str, Any] = {
    "run": {"name": "t"},
    "models": {"policy": {"model": "builtin:tiny"}},
    "tasks": {"digits": {"env": "envs.digits:make_env", "agent": "agents.digits:agent",
                         "model": "policy"}},
}


def recipe_text(**parts: Any) -> str:
    """GOOD_RECIPE with `parts` merged in, as YAML: recipe_text(models={"policy": {"seed": 3}})."""
    data = yaml.safe_load(yaml.safe_dump(GOOD_RECIPE))
    for key, value in parts.items():
        if key == "run":
            data["run"].update(value)
        else:  # models / tasks: one mapping of fields per name
            for name, fields in value.items():
                data[key].setdefault(name, {}).update(fields)
    return yaml.safe_dump(data)


def parsed_recipe(**parts: Any) -> Recipe:
    """GOOD_RECIPE with `parts` merged in, parsed as `jetctl up` parses a recipe file."""
    return parse_recipe(recipe_text(**parts), file="r.yaml", env={})
