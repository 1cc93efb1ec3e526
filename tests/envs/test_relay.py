"""envs/relay and envs/digits/team.py: each role of a team scored on its own part, and the
relay agent driving both roles through the scripted proxy."""

from __future__ import annotations

import json
import random
from typing import Any

import pytest

from envs.digits.team import make_env as make_team_digits
from envs.relay import answer_messages, answer_score, make_env
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
        ({"a": 2, "b": 5}, "7", {"caller": 1.0, "answerer": 1.0}, "add returned 7."),
        ({"a": "5", "b": 2}, "The result is 7.", {"caller": 1.0, "answerer": 0.2},
         "add returned 7."),
        # a wrong call is well formed (0.2); the answerer, told 8, cannot be right
        ({"a": 2, "b": 6}, "8", {"caller": 0.2, "answerer": 0.0}, "add returned 8."),
        ({"a": 2}, "7.", {"caller": 0.0, "answerer": 1.0}, "add failed"),
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


@pytest.mark.parametrize(
    ("reply", "reward"),
    [("7", 1.0), (" 7.\n", 1.0), ("The result is 7.", 0.2), ("7 + 0 = 7", 0.2),
     ("77", 0.0), ("17", 0.0), ("7.5", 0.0), ("0.7", 0.0), ("seven", 0.0), ("", 0.0)],
)
def test_the_answerer_is_paid_for_the_sum_alone_and_a_little_for_it_in_words(
    reply: str, reward: float
) -> None:
    assert answer_score(reply, 7) == reward


def test_the_answerers_prior_exchange_answers_the_example_with_the_number_alone() -> None:
    messages = answer_messages("add returned 8.")
    assert [m["role"] for m in messages] == ["user", "assistant", "user"]
    assert messages[0]["content"] == "add returned 7. Reply with the result."
    assert messages[1]["content"] == "7"
    assert messages[2]["content"] == "add returned 8. Reply with the result."


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
    task = env._task(2, 6)
    session = env.open(task)
    script = {"caller": tool_call("add", a=2, b=6), "answerer": "8"}
    with ScriptedEndpoint(lambda p: script["answerer"] if "Reply with the result" in p
                          else script["caller"], roles=("caller", "answerer")) as endpoint:
        llm = endpoint.llm
        agent(task, LLM(llm.base_url, "caller", roles=("caller", "answerer")), session)
        roles = [t.role for t in endpoint.timeline.turns] if endpoint.timeline else []
    assert session.operands == (2, 6) and session.reply == "8"
    assert session.reward() == {"caller": 1.0, "answerer": 1.0}
    assert roles == ["caller", "answerer"]
    # the answerer sees the example's exchange, then this rollout's result (not the question)
    answerer_prompt = endpoint.prompts[1]
    assert answerer_prompt.index("add returned 7.") < answerer_prompt.index("add returned 8.")
    assert "What is 2 + 6" not in answerer_prompt


def test_the_relay_agent_names_the_roles_it_needs() -> None:
    from agents.relay import agent
    from jetctl.env import LLM

    env = make_env()
    task = env._task(2, 5)
    with pytest.raises(ValueError, match="needs roles caller, answerer; this task has planner"):
        agent(task, LLM("http://127.0.0.1:1/v1", "planner", roles=("planner",)), env.open(task))
