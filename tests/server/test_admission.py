"""Admission checks at Submit: what is stale, what is malformed."""

from __future__ import annotations

import math

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from jetctl.proto._gen import packed_pb2
from jetctl.proto._gen import swarm_pb2 as pb
from jetctl.proto.convert import group_from_pb, group_to_pb, packed_groups
from jetctl.server.admission import (
    MAX_LOGPROB,
    MIN_LOGPROB,
    Limits,
    _logprobs_in_range,
    _varints_below,
    check_generate,
    check_group,
    check_groups,
)
from jetctl.server.store import GroupFacts
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
    decoded = group_from_pb(pb.TrajectoryGroup.FromString(group_to_pb(g).SerializeToString()))
    wire = check_group(decoded, LIMITS, 3, frozenset())
    assert fast == wire, defect
    assert fast.outcome == reference.outcome or defect.startswith("logprob"), defect
    if defect == "none":
        assert fast.outcome in ("accepted", "stale") and fast.facts == GroupFacts.of(g)
    elif defect != "repeated_id" or len(g.trajectories) > 1:
        assert fast.outcome == "invalid", defect


# --- a Submit's groups are judged from their packed bytes exactly as one by one


@settings(max_examples=150, deadline=None, derandomize=True, database=None)
@given(cases=st.lists(st.composite(defective)(), min_size=1, max_size=4))
def test_a_request_is_judged_from_its_packed_bytes_as_group_by_group(
    cases: list[tuple[str, TrajectoryGroup]],
) -> None:
    raw = pb.SubmitRequest(groups=[group_to_pb(g) for _, g in cases]).SerializeToString()
    req = pb.SubmitRequest.FromString(raw)
    one_by_one = [check_group(gm, LIMITS, 3, frozenset()) for gm in req.groups]
    packed = check_groups(req.groups, packed_groups(raw, len(req.groups)), LIMITS, 3, frozenset())
    assert packed == one_by_one, [d for d, _ in cases]


def _field(number: int, payload: bytes) -> bytes:
    """A length-delimited field: key, length, bytes."""
    return _varint(number << 3 | 2) + _varint(len(payload)) + payload


def _varint(n: int) -> bytes:
    n &= (1 << 64) - 1  # a negative int32 is sent as 10 bytes (two's complement, 64 bits)
    out = bytearray()
    while n >= 0x80:
        out.append(n & 0x7F | 0x80)
        n >>= 7
    return bytes(out) + bytes([n])


@pytest.mark.parametrize("extra_id, outcome", [(7, "accepted"), (LIMITS.vocab_size, "invalid")])
@pytest.mark.parametrize("encoding", ["unpacked", "second packed run"])
def test_ids_outside_the_first_packed_run_are_checked_too(
    extra_id: int, outcome: str, encoding: str
) -> None:
    """Parsers accept a repeated scalar unpacked (one varint field per element) or in several
    packed runs; the trainer would decode those ids too, so they are checked as well."""
    g = group_to_pb(make_group(version=3))
    call = g.trajectories[0].calls[0]
    extra = (_varint(2 << 3) + _varint(extra_id) if encoding == "unpacked"
             else _field(2, _varint(extra_id)))
    del g.trajectories[0].calls[:]
    trajectory = g.trajectories[0].SerializeToString() + _field(8, call.SerializeToString() + extra)
    del g.trajectories[0]
    raw = _field(1, g.SerializeToString() + _field(5, trajectory))
    req = pb.SubmitRequest.FromString(raw)
    assert list(req.groups[0].trajectories[-1].calls[0].prompt_ids)[-1] == extra_id
    verdicts = check_groups(req.groups, packed_groups(raw, len(req.groups)), LIMITS, 3, frozenset())
    assert [v.outcome for v in verdicts] == [outcome]
    assert verdicts == [check_group(req.groups[0], LIMITS, 3, frozenset())]


@pytest.mark.parametrize("vocab", [1, 100, 128, 129, 733, 2048, 49152, 151936, 2**31])
def test_packed_ids_are_bounded_as_their_values(vocab: int) -> None:
    """Ids at the edges of each varint length, against vocabularies whose last id does and
    does not fill its top byte; negative ids are 10-byte varints."""
    edges = {0, 1, 127, 128, 16383, 16384, 2**21 - 1, 2**21, 2**28, 2**31 - 1,
             vocab - 1, vocab, vocab + 1, 3 * 16384 + 7, -1, -(2**31)}
    for value in sorted(e for e in edges if -(2**31) <= e < 2**31):  # int32
        for others in ([], [0, vocab - 1], [vocab - 1, 5]):
            ids = [*others, value]
            data = packed_pb2.PackedCall.FromString(
                pb.LLMCall(prompt_ids=ids).SerializeToString()).prompt_ids[0]
            want = all(0 <= i < vocab for i in ids)
            assert _varints_below(data, len(ids), vocab) == want, (vocab, ids)
            assert not _varints_below(data, len(ids) + 1, vocab)


def test_packed_logprobs_are_bounded_as_their_values() -> None:
    """Each float32 against [MIN_LOGPROB, MAX_LOGPROB] as the element-by-element check
    compares it (in float64), around the edges of the top-byte screen (2**-11, 512)."""
    edges = [0.0, -0.0, 1e-30, -1e-30, 2**-11, 4.8e-4, 5e-4, 9.99e-4, MAX_LOGPROB, 1.01e-3,
             2e-3, 0.5, -0.5, -20.0, -511.9, -512.0, -600.0, -999.9, MIN_LOGPROB, -1000.1,
             -2048.0, -1e30, math.nan, math.inf, -math.inf]
    for value in edges:
        for others in ([], [-0.25], [-3.0, -700.0]):
            lps = [*others, value]
            data = packed_pb2.PackedCall.FromString(
                pb.LLMCall(completion_logprobs=lps).SerializeToString()).completion_logprobs[0]
            as_sent = [float(x) for x in pb.LLMCall.FromString(
                pb.LLMCall(completion_logprobs=lps).SerializeToString()).completion_logprobs]
            want = all(MIN_LOGPROB <= x <= MAX_LOGPROB for x in as_sent)  # False for NaN
            assert _logprobs_in_range(data) == want, lps
