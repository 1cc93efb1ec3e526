"""envs/relay and envs/digits/team.py: each role of a team scored on its own part, and the
relay agent driving both roles through the scripted proxy."""

from __future__ import annotations

import json
import random
from typing import Any

import pytest

from envs.digits.team import make_env as make_team_digits
from envs.relay import make_env
from tests.envs.scripted_llm import ScriptedEndpoint, tool_call

pytestmark = pytest.mark.unit


def test_relay_tasks_have_one_digit_sums_and_never_the_example() -> None:
    tasks = make_env().all_tasks()
    pairs = [tuple(t.data["operands"]) for t in tasks]
    assert len(pairs) == 54 and (3, 4) not in pairs and all(a + b <= 9 for a, b in pairs)
    assert len({t.id for t in tasks}) == len(tasks)
    first = next(make_env().tasks(random.Random(0)))
    assert first.data["messages"][-1]["content"].startswith(f"What is {first.data['operands'][0]}")
    # the prior exchange shows a call in OpenAI's shape (each model's template renders it)
    assert json.loads(first.data["messages"][1]["tool_calls"][0]["function"]["arguments"]) == {
        "a": 3, "b": 4}


@pytest.mark.parametrize(
    ("arguments", "reply", "rewards", "shown"),
    [
        ({"a": 2, "b": 5}, "7777", {"caller": 1.0, "answerer": 1.0}, "add returned 7."),
        ({"a": "5", "b": 2}, "77", {"caller": 1.0, "answerer": 0.5}, "add returned 7."),
        # a wrong call is well formed (0.2); the answerer, told 8, cannot be right
        ({"a": 2, "b": 6}, "8888", {"caller": 0.2, "answerer": 0.0}, "add returned 8."),
        ({"a": 2}, "7777", {"caller": 0.0, "answerer": 1.0}, "add failed"),
        (None, "", {"caller": 0.0, "answerer": 0.0}, "add was not called."),
    ],
)
def test_each_role_is_scored_on_its_part(
    arguments: Any, reply: str, rewards: dict[str, float], shown: str
) -> None:
    env = make_env()
    session = env.open(env._task(2, 5))
    if arguments is not None:
        session.add(arguments)
    assert session.result.startswith(shown)
    session.answer(reply)
    assert session.reward() == rewards


def test_team_digits_scores_each_role_against_its_digit() -> None:
    env = make_team_digits(digits={"seven": 7, "three": 3}, length=4)
    task = env.all_tasks()[0]
    assert task.data["prompts"] == {"seven": "Reply with the digit 7.",
                                     "three": "Reply with the digit 3."}
    session = env.open(task)
    assert session.submit("seven", "7777") == 1.0
    session.submit("three", "3x")
    assert session.reward() == {"seven": 1.0, "three": 0.25}
    with pytest.raises(KeyError, match="'four' is not one of"):
        session.submit("four", "4")
    with pytest.raises(ValueError, match="0-9"):
        make_team_digits(digits={"x": 12})


def test_the_relay_agent_calls_then_answers_with_the_tools_result() -> None:
    from agents.relay import agent
    from jetctl.env import LLM

    env = make_env()
    task = env._task(2, 5)
    session = env.open(task)
    script = {"caller": tool_call("add", a=2, b=5), "answerer": "7777"}
    with ScriptedEndpoint(lambda p: script["answerer"] if "Reply with the result" in p
                          else script["caller"], roles=("caller", "answerer")) as endpoint:
        llm = endpoint.llm
        agent(task, LLM(llm.base_url, "caller", roles=("caller", "answerer")), session)
        roles = [t.role for t in endpoint.timeline.turns] if endpoint.timeline else []
    assert session.operands == (2, 5) and session.reply == "7777"
    assert session.reward() == {"caller": 1.0, "answerer": 1.0}
    assert roles == ["caller", "answerer"]
    assert "add returned 7. Reply with the result." in endpoint.prompts[1]


def test_the_relay_agent_names_the_roles_it_needs() -> None:
    from agents.relay import agent
    from jetctl.env import LLM

    env = make_env()
    task = env._task(2, 5)
    with pytest.raises(ValueError, match="needs roles caller, answerer; this task has planner"):
        agent(task, LLM("http://127.0.0.1:1/v1", "planner", roles=("planner",)), env.open(task))
