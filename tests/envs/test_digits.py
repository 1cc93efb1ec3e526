"""envs/digits: dense reward checked by code, stable task ids, and the crashy agent's rule."""

from __future__ import annotations

import random

import pytest

from agents.crashy import crashes
from envs.digits import make_env, score


@pytest.mark.unit
def test_correct_and_wrong_replies_score_as_documented() -> None:
    env = make_env()
    task = next(env.tasks(random.Random(0)))
    assert env.open(task).submit("7777") == 1.0
    assert env.open(task).submit(" 7 7 7 7\n") == 1.0  # whitespace does not count
    assert env.open(task).submit("77") == 0.5  # out of length=4
    assert env.open(task).submit("7abc") == 0.25
    assert env.open(task).submit("hello world") == 0.0
    assert env.open(task).submit("") == 0.0
    assert env.open(task).reward() == 0.0  # nothing submitted


@pytest.mark.unit
def test_first_submit_counts() -> None:
    env = make_env()
    session = env.open(env.all_tasks()[0])
    session.submit("abcd")
    assert session.submit("7777") == 0.0


@pytest.mark.unit
def test_score_is_the_token_fraction_for_max_length_replies() -> None:
    # with `length` characters (= tokens for digits on builtin:tiny) it is count / length
    assert score("7a7b", "7", 4) == 0.5
    assert score("777777", "7", 4) == 1.0
    assert score("3333", "3", 4) == 1.0


@pytest.mark.unit
def test_task_ids_are_stable_and_prompts_name_the_digit() -> None:
    env = make_env(digit=3)
    ids = [t.id for t in env.all_tasks()]
    assert ids == ["digits-3-0", "digits-3-1", "digits-3-2", "digits-3-3"]
    assert all("3" in t.prompt for t in env.all_tasks())
    a = [t.id for _, t in zip(range(20), env.tasks(random.Random(5)))]
    b = [t.id for _, t in zip(range(20), env.tasks(random.Random(5)))]
    assert a == b and set(a) <= set(ids)


@pytest.mark.unit
def test_bad_args_fail_with_the_value() -> None:
    with pytest.raises(ValueError, match="digit \\(12\\)"):
        make_env(digit=12)
    with pytest.raises(ValueError, match="length \\(0\\)"):
        make_env(length=0)


@pytest.mark.unit
def test_crashy_agent_crashes_on_a_known_half_of_the_digits_tasks() -> None:
    ids = [t.id for t in make_env().all_tasks()]
    assert [crashes(i) for i in ids] == [True, False, False, True]


class _FakeLLM:
    """An endpoint that always replies `reply` and records max_tokens (a fake, not a mock)."""

    model = "policy"

    def __init__(self, reply: str) -> None:
        self.reply = reply
        self.max_tokens: list[int] = []
        self.chat = self
        self.completions = self

    def client(self) -> _FakeLLM:
        return self

    def create(self, *, max_tokens: int, **_: object) -> object:
        from openai.types.chat import ChatCompletion

        self.max_tokens.append(max_tokens)
        choice = {
            "index": 0,
            "finish_reason": "length",
            "message": {"role": "assistant", "content": self.reply},
        }
        return ChatCompletion.model_validate(
            {
                "id": "x",
                "object": "chat.completion",
                "created": 0,
                "model": "policy",
                "choices": [choice],
            }
        )


@pytest.mark.unit
def test_digits_agent_submits_the_reply_and_crashy_fails_after_its_call() -> None:
    from agents.crashy import DeliberateCrash
    from agents.crashy import agent as crashy
    from agents.digits import agent

    env = make_env()
    calm, doomed = env.all_tasks()[1], env.all_tasks()[0]
    llm = _FakeLLM("7 7a")
    session = env.open(calm)
    agent(calm, llm, session)  # type: ignore[arg-type]
    assert session.reward() == 0.5 and llm.max_tokens == [4]
    crashy(calm, llm, env.open(calm))  # type: ignore[arg-type]
    with pytest.raises(DeliberateCrash, match="digits-7-0"):
        crashy(doomed, llm, env.open(doomed))  # type: ignore[arg-type]
    assert len(llm.max_tokens) == 3  # the crash came after the LLM call
