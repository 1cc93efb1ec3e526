"""envs/arithmetic: rewards per turn, the feedback flow, parsing, and stable task ids."""

from __future__ import annotations

import random

import pytest

from envs.arithmetic import make_env, parse_answer
from envs.arithmetic.env import FEEDBACK


@pytest.mark.unit
def test_correct_on_the_first_turn_scores_one() -> None:
    env = make_env()
    session = env.open(env.task(2, 5))
    assert session.answer("<answer>7</answer>") is None
    assert session.done and session.reward() == 1.0


@pytest.mark.unit
def test_wrong_then_right_gets_feedback_then_scores_point_six() -> None:
    env = make_env()
    session = env.open(env.task(2, 5))
    assert session.answer("<answer>8</answer>") == FEEDBACK
    assert not session.done and session.reward() == 0.2
    assert session.answer("Sorry. <ANSWER> 7 </Answer>") is None
    assert session.done and session.reward() == 0.6


@pytest.mark.unit
def test_never_correct_scores_by_form() -> None:
    env = make_env()
    wrong = env.open(env.task(2, 5))
    assert wrong.answer("<answer>8</answer>") == FEEDBACK
    assert wrong.answer("no idea") is None  # out of turns: done, no more feedback
    assert wrong.done and wrong.reward() == 0.2
    assert wrong.answer("<answer>7</answer>") is None and wrong.reward() == 0.2  # too late

    malformed = env.open(env.task(2, 5))
    malformed.answer("7")
    malformed.answer("Guess: 7")
    assert malformed.reward() == 0.0
    assert env.open(env.task(2, 5)).reward() == 0.0  # no answer at all


@pytest.mark.unit
def test_max_turns_bounds_the_conversation() -> None:
    env = make_env(max_turns=3)
    session = env.open(env.task(1, 1))
    assert session.answer("3") == FEEDBACK
    assert session.answer("4") == FEEDBACK
    assert session.answer("<answer>2</answer>") is None and session.reward() == 0.6
    single = make_env(max_turns=1).open(env.task(1, 1))
    assert single.answer("<answer>3</answer>") is None and single.done


@pytest.mark.unit
def test_parse_answer() -> None:
    assert parse_answer("<answer>12</answer>") == 12
    assert parse_answer("x <Answer>\n-3\n</ANSWER> <answer>5</answer>") == -3  # first tag counts
    assert parse_answer("<answer>seven</answer>") is None
    assert parse_answer("answer: 7") is None


@pytest.mark.unit
def test_chat_opens_with_the_one_shot_example_then_the_question() -> None:
    task = make_env().task(6, 2)
    assert task.prompt == "What is 6 + 2? Answer as <answer>N</answer>."
    assert task.data["messages"] == [
        {"role": "user", "content": "What is 3 + 4? Answer as <answer>N</answer>."},
        {"role": "assistant", "content": "<answer>7</answer>"},
        {"role": "user", "content": task.prompt},
    ]
    assert task.data["answer"] == 8


@pytest.mark.unit
def test_task_ids_are_stable_and_seeded_streams_repeat() -> None:
    env = make_env(digits=1)
    assert env.task(6, 2).id == "add-6+2"
    draw = lambda e, rng: [t.id for _, t in zip(range(50), e.tasks(rng))]
    assert draw(env, random.Random(1)) == draw(env, random.Random(1))
    ids = draw(env, random.Random(1))
    assert "add-3+4" not in ids  # the example is never asked
    assert all(0 <= int(x) <= 9 for i in ids for x in i.removeprefix("add-").split("+"))
    seeded = make_env(seed=7)
    assert draw(seeded, random.Random(1)) == draw(seeded, random.Random(2))
    two = [t.data["answer"] for _, t in zip(range(50), make_env(digits=2).tasks(random.Random(0)))]
    assert max(two) > 18


@pytest.mark.unit
def test_bad_args_fail_with_the_value() -> None:
    with pytest.raises(ValueError, match="max_turns \\(0\\)"):
        make_env(max_turns=0)
    with pytest.raises(ValueError, match="digits \\(0\\)"):
        make_env(digits=0)


class _FakeCompletions:
    """Replies from a script and records the messages it was sent (a fake, not a mock)."""

    def __init__(self, replies: list[str]) -> None:
        self.replies = list(replies)
        self.seen: list[list[dict[str, object]]] = []

    def _make(self, messages: list[dict[str, object]]) -> object:
        from openai.types.chat import ChatCompletion

        self.seen.append([dict(m) for m in messages])
        return ChatCompletion.model_validate(
            {
                "id": "x",
                "object": "chat.completion",
                "created": 0,
                "model": "policy",
                "choices": [
                    {
                        "index": 0,
                        "finish_reason": "stop",
                        "message": {"role": "assistant", "content": self.replies.pop(0)},
                    }
                ],
            }
        )

    def create(self, *, messages: list[dict[str, object]], **_: object) -> object:
        return self._make(messages)


class _FakeAsyncCompletions(_FakeCompletions):
    async def create(self, *, messages: list[dict[str, object]], **_: object) -> object:  # type: ignore[override]
        return self._make(messages)


class _FakeClient:
    def __init__(self, completions: _FakeCompletions) -> None:
        self.chat = type("Chat", (), {"completions": completions})()

    async def close(self) -> None:
        pass


class _FakeLLM:
    base_url = "http://fake"
    model = "policy"

    def __init__(self, replies: list[str]) -> None:
        self.sync = _FakeCompletions(replies)
        self.async_ = _FakeAsyncCompletions(replies)

    def client(self) -> _FakeClient:
        return _FakeClient(self.sync)

    def async_client(self) -> _FakeClient:
        return _FakeClient(self.async_)


@pytest.mark.unit
def test_agent_sends_feedback_and_keeps_replies_verbatim() -> None:
    from agents.arithmetic import agent

    env = make_env()
    task = env.task(2, 5)
    session = env.open(task)
    llm = _FakeLLM(["<answer>8</answer>", " <answer>7</answer> "])
    agent(task, llm, session)  # type: ignore[arg-type]
    assert session.reward() == 0.6
    second_call = llm.sync.seen[1]
    assert llm.sync.seen[0] == task.data["messages"]
    assert second_call[:3] == task.data["messages"]
    assert second_call[3:] == [
        {"role": "assistant", "content": "<answer>8</answer>"},
        {"role": "user", "content": FEEDBACK},
    ]


@pytest.mark.unit
async def test_async_agent_stops_when_correct() -> None:
    from agents.arithmetic import agent_async

    env = make_env(max_turns=3)
    task = env.task(4, 4)
    session = env.open(task)
    llm = _FakeLLM(["<answer>8</answer>", "unused"])
    await agent_async(task, llm, session)  # type: ignore[arg-type]
    assert session.reward() == 1.0 and len(llm.async_.seen) == 1
