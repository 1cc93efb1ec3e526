"""Admission checks at Submit: what is stale, what is malformed."""

from __future__ import annotations

import math

import pytest

from jetctl.server.admission import Limits, check_generate, check_group
from tests.factories import make_group

pytestmark = pytest.mark.unit

LIMITS = Limits(model="policy", vocab_size=100, max_context_tokens=64, max_staleness=2)


def test_fresh_group_is_accepted() -> None:
    assert check_group(make_group(version=3), LIMITS, 4, frozenset()).outcome == "accepted"


def test_lag_beyond_max_staleness_is_stale() -> None:
    v = check_group(make_group(version=1), LIMITS, 4, frozenset())
    assert v.outcome == "stale" and "lag 3 > max_staleness 2" in v.reason


@pytest.mark.parametrize(
    "mutate, fragment",
    [
        (lambda g: setattr(g, "model", "other"), "not served here"),
        (lambda g: setattr(g.trajectories[0], "reward", math.nan), "reward is nan"),
        (lambda g: setattr(g.trajectories[0].calls[0], "completion_logprobs", [-1.0]), "logprobs"),
        (lambda g: setattr(g.trajectories[0].calls[0], "completion_ids", [4, 500]), "vocabulary"),
        (lambda g: setattr(g.trajectories[0].calls[0], "model_version", 99), "model_version 99"),
        (lambda g: setattr(g.trajectories[0], "group_id", "x"), "group_id"),
        (lambda g: setattr(g.trajectories[1], "id", g.trajectories[0].id), "repeated"),
        (lambda g: setattr(g.trajectories[0].calls[0], "prompt_ids", [1] * 70), "max_context"),
        (lambda g: setattr(g.trajectories[0].calls[0], "completion_logprobs", [0.5, -1]), "positive"),
    ],
)
def test_malformed_groups_are_invalid(mutate, fragment: str) -> None:  # type: ignore[no-untyped-def]
    g = make_group()
    mutate(g)
    v = check_group(g, LIMITS, 4, frozenset())
    assert v.outcome == "invalid" and fragment in v.reason, v.reason


def test_refused_revision() -> None:
    v = check_group(make_group(version=4), LIMITS, 4, frozenset({"r0"}))
    assert v.outcome == "revision"


def test_generate_checks() -> None:
    assert check_generate("policy", [1, 2], 8, LIMITS, 16) == ""
    assert "not served" in check_generate("x", [1], 8, LIMITS, 16)
    assert "empty" in check_generate("policy", [], 8, LIMITS, 16)
    assert "exceeds" in check_generate("policy", [1] * 60, 8, LIMITS, 16)
