"""Absurd but well-formed input is refused by the pure admission checks (no socket)."""

from __future__ import annotations

import math

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from jetctl.proto.convert import group_to_pb
from jetctl.server.admission import (
    MIN_LOGPROB,
    Limits,
    check_generate,
    check_group,
)
from tests.factories import make_group

pytestmark = pytest.mark.unit

LIMITS = Limits(model="policy", vocab_size=100, max_context_tokens=64, max_staleness=2)


def verdict(mutate: object) -> str:
    g = make_group(version=1)
    mutate(g)  # type: ignore[operator]
    v = check_group(g, LIMITS, version=1, refused_revisions=frozenset())
    return f"{v.outcome}: {v.reason}"


@pytest.mark.parametrize(
    ("mutate", "words"),
    [
        (lambda g: setattr(g.trajectories[0], "reward", 1e300), "reward"),
        (lambda g: setattr(g.trajectories[0], "reward", -math.inf), "reward"),
        (lambda g: g.trajectories[0].calls[0].completion_logprobs.__setitem__(0, -1e30),
         "not from a sampler"),
        (lambda g: setattr(g, "id", "x" * 300), "group id has 300 characters"),
        (lambda g: setattr(g, "task", "t" * 300), "task has 300 characters"),
        (lambda g: g.trajectories[0].calls.extend(g.trajectories[0].calls * 1024), "calls"),
    ],
)
def test_absurd_values_are_invalid(mutate: object, words: str) -> None:
    out = verdict(mutate)
    assert out.startswith("invalid") and words in out, out
    assert len(out) < 400, "a reason echoes input only in part"


def test_shape_is_read_from_the_protobuf_before_conversion() -> None:
    g = group_to_pb(make_group(version=1))
    assert check_group(g, LIMITS, version=1, refused_revisions=frozenset()).outcome == "accepted"
    g.trajectories[0].calls[0].prompt_ids.extend([1] * 1000)
    v = check_group(g, LIMITS, version=1, refused_revisions=frozenset())
    assert v.outcome == "invalid" and "max_context_tokens" in v.reason, v


def test_logprob_floor_keeps_real_logprobs() -> None:
    out = verdict(lambda g: g.trajectories[0].calls[0].completion_logprobs.__setitem__(
        0, MIN_LOGPROB + 1))
    assert out.startswith("accepted"), out


@settings(max_examples=200, deadline=None)
@given(temperature=st.floats(allow_nan=True, allow_infinity=True))
def test_generate_temperature_must_be_finite_and_non_negative(temperature: float) -> None:
    reason = check_generate("policy", [1, 2], 4, LIMITS, 8, temperature=temperature)
    assert (reason == "") == (0 <= temperature < math.inf), (temperature, reason)
