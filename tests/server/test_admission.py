"""Admission checks at Submit: what is stale, what is malformed."""

from __future__ import annotations

import math

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from jetctl.proto.convert import group_to_pb
from jetctl.server.admission import Limits, check_generate, check_group
from jetctl.server.store import GroupCodec, GroupFacts
from jetctl.types import LLMCall, TrajectoryGroup
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


# --- a group is judged as the protobuf it arrived in: exactly as its decoded dataclass

DEFECTS = [
    "none", "token_negative", "token_at_vocab", "token_huge", "logprob_nan", "logprob_inf",
    "logprob_positive", "logprob_tiny_positive", "logprob_floor", "logprob_count",
    "reward_nan", "reward_huge", "version_future", "version_negative", "call_model",
    "group_model", "status", "repeated_id", "empty_id", "group_id", "empty_prompt",
    "context", "no_calls", "long_revision", "no_trajectories",
]


def defective(draw: st.DrawFn) -> tuple[str, TrajectoryGroup]:
    rng = draw(st.randoms(use_true_random=False))
    n_traj = draw(st.integers(1, 4))
    g = make_group(rewards=tuple(draw(st.floats(-5, 5)) for _ in range(n_traj)), version=2)
    for t in g.trajectories:
        t.calls = [
            LLMCall("policy", [rng.randrange(LIMITS.vocab_size) for _ in range(rng.randint(1, 30))],
                    ids := [rng.randrange(LIMITS.vocab_size) for _ in range(rng.randint(1, 20))],
                    [-rng.random() * 20 for _ in ids], rng.randint(0, 3))
            for _ in range(draw(st.integers(1, 3)))
        ]
    defect = draw(st.sampled_from(DEFECTS))
    t = g.trajectories[rng.randrange(len(g.trajectories))]
    c = t.calls[rng.randrange(len(t.calls))]
    if defect == "token_negative":
        c.prompt_ids[rng.randrange(len(c.prompt_ids))] = -rng.randint(1, 2**31)
    elif defect == "token_at_vocab":
        c.completion_ids[-1] = LIMITS.vocab_size
    elif defect == "token_huge":
        c.prompt_ids[0] = 2**31 - 1
    elif defect in ("logprob_nan", "logprob_inf", "logprob_positive", "logprob_tiny_positive",
                    "logprob_floor"):
        c.completion_logprobs[rng.randrange(len(c.completion_logprobs))] = {
            "logprob_nan": math.nan, "logprob_inf": -math.inf, "logprob_positive": 0.5,
            # float32(1e-3) is above the float64 bound: both passes must compare alike
            "logprob_tiny_positive": 1e-3, "logprob_floor": -1000.5,
        }[defect]
    elif defect == "logprob_count":
        c.completion_logprobs.append(-1.0)
    elif defect == "reward_nan":
        t.reward = math.nan
    elif defect == "reward_huge":
        t.reward = 2e9
    elif defect == "version_future":
        c.model_version = 5
    elif defect == "version_negative":
        c.model_version = -1
    elif defect == "call_model":
        c.model = "other"
    elif defect == "group_model":
        g.model = "other"
    elif defect == "status":
        t.status = "failed"
    elif defect == "repeated_id" and len(g.trajectories) > 1:
        g.trajectories[1].id = g.trajectories[0].id
    elif defect == "empty_id":
        t.id = ""
    elif defect == "group_id":
        t.group_id = "someone-else"
    elif defect == "empty_prompt":
        c.prompt_ids = []
    elif defect == "context":
        c.prompt_ids = [1] * (LIMITS.max_context_tokens - len(c.completion_ids) + 1)
    elif defect == "no_calls":
        t.calls = []
    elif defect == "long_revision":
        t.client_revision = "r" * 300
    elif defect == "no_trajectories":
        g.trajectories = []
    return defect, g


@settings(max_examples=400, deadline=None, derandomize=True, database=None)
@given(case=st.composite(defective)())
def test_a_protobuf_group_is_judged_as_its_decoded_dataclass(
    case: tuple[str, TrajectoryGroup],
) -> None:
    defect, g = case
    reference = check_group(g, LIMITS, 3, frozenset())
    fast = check_group(group_to_pb(g), LIMITS, 3, frozenset())
    # logprobs travel as float32: compare against the group as the wire carries it
    wire = check_group(GroupCodec().decode(group_to_pb(g).SerializeToString()), LIMITS, 3,
                       frozenset())
    assert fast == wire, defect
    assert fast.outcome == reference.outcome or defect.startswith("logprob"), defect
    if defect == "none":
        assert fast.outcome in ("accepted", "stale") and fast.facts == GroupFacts.of(g)
    elif defect != "repeated_id" or len(g.trajectories) > 1:
        assert fast.outcome == "invalid", defect
