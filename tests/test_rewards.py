"""Rewards of dataset tasks (jetctl/rewards.py): extraction, the built-in answer rewards,
and `score`: sync or async, a number or a per-role mapping, a timeout, a raise."""

from __future__ import annotations

import asyncio
import time
from typing import Any

import pytest

from jetctl.rewards import (
    RewardError,
    exact_match,
    extract_answer,
    make_answer_reward,
    math_equal,
    score,
)

pytestmark = pytest.mark.unit


@pytest.mark.parametrize(("text", "expected"), [
    ("so <answer> 42 </answer> done", "42"),
    ("<ANSWER>7</ANSWER> then <answer>8</answer>", "7"),  # the first tag counts
    ("the total is \\boxed{\\frac{1}{2}}.", "\\frac{1}{2}"),  # braces balanced
    ("3 apples and 4 pears make 7", "7"),  # the last number
    ("it costs 1,250.", "1,250"),
    ("no number here", None),
])
def test_extraction(text: str, expected: str | None) -> None:
    assert extract_answer(text) == expected


def test_exact_match_normalises_numbers_and_partial_credit_is_only_for_a_wrong_answer() -> None:
    row = {"answer": 1250}
    assert exact_match("<answer>1,250.0</answer>", row) == 1.0
    assert exact_match("<answer>1251</answer>", row) == 0.0
    tags_only = make_answer_reward(extract=["tags"], partial=0.2)
    assert tags_only("<answer>3</answer>", row) == 0.2
    assert tags_only("1250", row) == 0.0  # not in tags: not well formed
    with pytest.raises(KeyError, match="no 'answer' column"):
        exact_match("1", {"gold": 1})


def test_math_equal_uses_math_verify() -> None:
    assert math_equal("\\boxed{\\frac{1}{2}}", {"answer": "0.5"}) == 1.0
    assert math_equal("<answer>2/4</answer>", {"answer": "1/2"}) == 1.0
    assert math_equal("<answer>1/3</answer>", {"answer": "1/2"}) == 0.0
    assert exact_match("<answer>2/4</answer>", {"answer": "1/2"}) == 0.0  # strings differ


async def async_reward(completion: str, row: dict[str, Any]) -> float:
    await asyncio.sleep(0)
    return 0.5


def conversation_reward(completion: str, row: dict[str, Any], messages: list[dict[str, Any]]) -> dict[str, float]:
    return {"asker": float(len(messages)), "answerer": 1.0}


def test_score_takes_async_rewards_role_mappings_and_the_conversation() -> None:
    msgs = [{"role": "user", "content": "q"}, {"role": "assistant", "content": "a"}]
    assert score(async_reward, "a", {}, msgs, timeout_s=5) == 0.5
    assert score(conversation_reward, "a", {}, msgs, timeout_s=5) == {"asker": 2.0, "answerer": 1.0}


def test_a_slow_or_raising_or_odd_reward_is_a_reward_error() -> None:
    def slow(completion: str, row: dict[str, Any]) -> float:
        time.sleep(2)
        return 1.0

    t0 = time.monotonic()
    with pytest.raises(RewardError, match="ran past reward_timeout_s=0.2"):
        score(slow, "a", {}, [], timeout_s=0.2)
    assert time.monotonic() - t0 < 1.5
    with pytest.raises(RewardError, match="raised ZeroDivisionError"):
        score(lambda c, r: 1 / 0, "a", {}, [], timeout_s=5)
    with pytest.raises(RewardError, match="returned str"):
        score(lambda c, r: "1", "a", {}, [], timeout_s=5)
