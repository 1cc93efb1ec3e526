"""Hypothesis fuzzing of Submit and Generate against a real `jetctl server` (builtin:tiny).

Each case is refused with the code gRPC's guide gives (malformed -> INVALID_ARGUMENT, too
many -> RESOURCE_EXHAUSTED, per-group INVALID / STALE acks in a call that carries one usable
group), a valid call succeeds right after it, and the server's RSS stays bounded.

The server trains exactly one step (max_steps 1) and then serves at version 1 with
max_staleness 0, so a group made at version 0 is STALE and one made at version 2 is from
the future. Examples are derandomized: CI sees the same cases every run.
"""

from __future__ import annotations

import math
import time
from collections.abc import Iterator
from dataclasses import dataclass

import grpc
import psutil
import pytest
from google.protobuf.message import DecodeError
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from jetctl.auth import bearer
from jetctl.proto._gen import swarm_pb2 as pb
from jetctl.proto._gen import swarm_pb2_grpc
from jetctl.types import uuid7
from tests.security.server_proc import TOKEN, running_server, tiny_recipe

pytestmark = [pytest.mark.integration, pytest.mark.timeout(300)]

VOCAB = 733  # builtin:tiny
CONTEXT = 256  # generation.max_context_tokens in tiny_recipe
MAX_NEW = 8  # generation.max_new_tokens
VERSION = 1  # the server's version once its single step is done
EXAMPLES = 200
# RSS may grow by the buffered valid groups and allocator slack, not by what was refused:
# 800 cases grew it by ~30 MiB here (buffered valid groups, allocator slack).
RSS_GROWTH_BOUND = 150 << 20

FUZZ = settings(
    max_examples=EXAMPLES, deadline=None, derandomize=True, database=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
)


@dataclass(frozen=True)
class Target:
    stub: swarm_pb2_grpc.SwarmStub
    raw_submit: grpc.UnaryUnaryMultiCallable
    raw_generate: grpc.UnaryUnaryMultiCallable
    pid: int
    baseline_rss: int  # before the first fuzz case; the model and its one step are in


@pytest.fixture(scope="module")
def target(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Target]:
    run_dir = tmp_path_factory.mktemp("fuzz-run")
    recipe = tiny_recipe(max_staleness=0, max_steps=VERSION)
    with running_server(run_dir, recipe) as srv:
        channel = grpc.insecure_channel(
            srv.endpoint, options=[("grpc.max_send_message_length", 64 << 20)]
        )
        stub = swarm_pb2_grpc.SwarmStub(channel)
        # one accepted group, one optimizer step: the server then sits at VERSION
        reply = stub.Submit(pb.SubmitRequest(groups=[group(version=0)]), metadata=bearer(TOKEN),
                            timeout=30)
        assert [a.code for a in reply.acks] == [pb.Ack.ACCEPTED]
        deadline = time.monotonic() + 60
        while status(stub).model_version < VERSION:
            assert time.monotonic() < deadline, srv.log()
            time.sleep(0.2)
        yield Target(
            stub,
            channel.unary_unary("/jetctl.swarm.v1.Swarm/Submit"),  # raw bytes both ways
            channel.unary_unary("/jetctl.swarm.v1.Swarm/Generate"),
            srv.proc.pid,
            psutil.Process(srv.proc.pid).memory_info().rss,
        )
        channel.close()


def status(stub: swarm_pb2_grpc.SwarmStub) -> pb.StatusReply:
    return stub.Status(pb.StatusRequest(), metadata=bearer(TOKEN), timeout=10)  # type: ignore[no-any-return]


def group(version: int = VERSION, n: int = 2) -> pb.TrajectoryGroup:
    """A valid group: fresh ids, in-vocabulary tokens, finite rewards and logprobs."""
    gid = uuid7()
    g = pb.TrajectoryGroup(id=gid, task="digits", task_id="t0", model="policy")
    for i in range(n):
        g.trajectories.append(pb.Trajectory(
            id=uuid7(), group_id=gid, task="digits", task_id="t0", client_revision="r0",
            status="ok", reward=float(i),
            calls=[pb.LLMCall(model="policy", prompt_ids=[5, 6, 7], completion_ids=[8, 9],
                              completion_logprobs=[-1.0, -2.5], model_version=version)],
        ))
    return g


def call(fn: grpc.UnaryUnaryMultiCallable, request: object) -> tuple[grpc.StatusCode, object]:
    try:
        return grpc.StatusCode.OK, fn(request, metadata=bearer(TOKEN), timeout=60)
    except grpc.RpcError as e:
        return e.code(), e.details()


def still_serving(t: Target) -> None:
    reply = t.stub.Submit(pb.SubmitRequest(groups=[group()]), metadata=bearer(TOKEN), timeout=30)
    assert [a.code for a in reply.acks] == [pb.Ack.ACCEPTED]


# --------------------------------------------------------------------------- Submit

# each defect turns a valid group into one the server must ack with the code beside it
INVALID, STALE, ACCEPTED = pb.Ack.INVALID, pb.Ack.STALE, pb.Ack.ACCEPTED


@st.composite
def defective_group(draw: st.DrawFn) -> tuple[str, pb.TrajectoryGroup, int]:
    g = group()
    t = g.trajectories[-1]
    c = t.calls[0]
    defect = draw(st.sampled_from([
        "logprob_count", "reward_nan", "reward_inf", "reward_huge", "logprob_nan",
        "logprob_inf", "logprob_positive", "logprob_absurd", "future_version",
        "negative_version", "token_negative", "token_huge", "unknown_model",
        "unknown_call_model", "empty_group", "empty_id", "long_id", "repeated_traj_id",
        "wrong_group_id", "failed_status", "no_calls", "huge_prompt", "many_calls",
        "many_trajectories", "stale", "big_metadata",
    ]))
    code = INVALID
    if defect == "logprob_count":
        c.completion_logprobs.extend(draw(st.lists(st.floats(-5, 0), min_size=1, max_size=3)))
    elif defect == "reward_nan":
        t.reward = math.nan
    elif defect == "reward_inf":
        t.reward = draw(st.sampled_from([math.inf, -math.inf]))
    elif defect == "reward_huge":
        t.reward = draw(st.floats(1e10, 1e308)) * draw(st.sampled_from([1, -1]))
    elif defect in ("logprob_nan", "logprob_inf", "logprob_positive", "logprob_absurd"):
        c.completion_logprobs[draw(st.integers(0, 1))] = {
            "logprob_nan": math.nan,
            "logprob_inf": draw(st.sampled_from([math.inf, -math.inf])),
            "logprob_positive": draw(st.floats(0.01, 3e38)),
            "logprob_absurd": draw(st.floats(-3e38, -1001.0)),
        }[defect]
    elif defect == "future_version":
        c.model_version = draw(st.integers(VERSION + 1, 2**63 - 1))
    elif defect == "negative_version":
        c.model_version = draw(st.integers(-(2**63), -1))
    elif defect == "token_negative":
        c.prompt_ids[0] = draw(st.integers(-(2**31), -1))
    elif defect == "token_huge":
        c.completion_ids[1] = draw(st.integers(VOCAB, 2**31 - 1))
    elif defect == "unknown_model":
        g.model = draw(st.text(max_size=300).filter(lambda s: s != "policy"))
    elif defect == "unknown_call_model":
        c.model = draw(st.text(max_size=20).filter(lambda s: s != "policy"))
    elif defect == "empty_group":
        del g.trajectories[:]
    elif defect == "empty_id":
        g.id = ""
    elif defect == "long_id":
        g.id = "g" * draw(st.integers(257, 200_000))
        for tr in g.trajectories:
            tr.group_id = g.id
    elif defect == "repeated_traj_id":
        t.id = g.trajectories[0].id
    elif defect == "wrong_group_id":
        t.group_id = uuid7()
    elif defect == "failed_status":
        t.status = draw(st.sampled_from(["failed", "timeout", "", "OK"]))
    elif defect == "no_calls":
        del t.calls[:]
    elif defect == "huge_prompt":  # a repeated field far past the context, under the byte cap
        c.prompt_ids.extend([1] * draw(st.integers(CONTEXT, 4_000_000)))
    elif defect == "many_calls":
        t.calls.extend([c] * draw(st.integers(1024, 20_000)))
    elif defect == "many_trajectories":
        for _ in range(draw(st.integers(1023, 1500))):
            g.trajectories.add(id=uuid7(), group_id=g.id)
    elif defect == "stale":
        for tr in g.trajectories:
            tr.calls[0].model_version = VERSION - 1
        code = STALE
    elif defect == "big_metadata":  # valid: free text is the user's, up to the byte cap
        t.metadata["note"] = draw(st.text(max_size=50)) * draw(st.integers(1, 2000))
        code = ACCEPTED
    return defect, g, code


@pytest.mark.timeout(240)
@FUZZ
@given(
    bad=st.lists(defective_group(), min_size=1, max_size=3),
    companion=st.booleans(),
)
def test_submit_fuzz(target: Target, bad: list[tuple[str, pb.TrajectoryGroup, int]],
                     companion: bool) -> None:
    groups = ([group()] if companion else []) + [g for _, g, _ in bad]
    expected = ([ACCEPTED] if companion else []) + [code for _, _, code in bad]
    code, reply = call(target.stub.Submit, pb.SubmitRequest(groups=groups))
    defects = [d for d, _, _ in bad]
    if all(e == INVALID for e in expected):
        # nothing usable: the call as a whole is refused, with every group's reason
        assert code == grpc.StatusCode.INVALID_ARGUMENT, (defects, code, reply)
        assert isinstance(reply, str) and "invalid" in reply and len(reply) <= 2000
    else:
        assert code == grpc.StatusCode.OK, (defects, code, reply)
        assert isinstance(reply, pb.SubmitReply)
        assert [a.code for a in reply.acks] == expected, (defects, reply.acks)
        for ack in reply.acks:
            assert len(ack.reason) < 1000, "reasons echo input: they are bounded"
    still_serving(target)


@pytest.mark.timeout(240)
@FUZZ
@given(data=st.binary(max_size=4096))
def test_submit_garbage_bytes(target: Target, data: bytes) -> None:
    code, reply = call(target.raw_submit, data)
    try:
        pb.SubmitRequest.FromString(data)
    except DecodeError:
        assert code == grpc.StatusCode.INVALID_ARGUMENT, (code, reply)
    else:  # bytes that happen to parse are judged like any request: never a crash
        assert code in (grpc.StatusCode.OK, grpc.StatusCode.INVALID_ARGUMENT,
                        grpc.StatusCode.RESOURCE_EXHAUSTED), (code, reply)
    still_serving(target)


def test_submit_caps(target: Target) -> None:
    """Many tiny groups (under the byte cap) and one message over it: RESOURCE_EXHAUSTED."""
    tiny = pb.SubmitRequest(groups=[pb.TrajectoryGroup(id=str(i)) for i in range(100_000)])
    code, _ = call(target.stub.Submit, tiny)
    assert code == grpc.StatusCode.RESOURCE_EXHAUSTED
    big = pb.SubmitRequest(groups=[group()])
    big.groups[0].trajectories[0].metadata["blob"] = "x" * (17 << 20)  # > 16 MiB cap
    code, _ = call(target.stub.Submit, big)
    assert code == grpc.StatusCode.RESOURCE_EXHAUSTED
    still_serving(target)


# --------------------------------------------------------------------------- Generate

floats = st.floats(allow_nan=True, allow_infinity=True, width=32)


@st.composite
def generate_request(draw: st.DrawFn) -> pb.GenerateRequest:
    req = pb.GenerateRequest(
        model=draw(st.sampled_from(["policy", ""]) | st.text(max_size=40)),
        max_tokens=draw(st.integers(-(2**31), 2**31 - 1) | st.integers(0, MAX_NEW)),
        top_p=draw(floats),
        stop_token_ids=draw(st.lists(st.integers(-(2**31), 2**31 - 1), max_size=5)),
        seed=draw(st.integers(-(2**63), 2**63 - 1)),
    )
    if draw(st.booleans()):
        req.temperature = draw(floats | st.sampled_from([0.0, 1e-30, 1e-6, 0.7, 1e30]))
    if draw(st.integers(0, 9)) == 0:
        req.prompt_ids.extend([3] * draw(st.integers(CONTEXT, 2_000_000)))
    else:
        ids = st.integers(0, VOCAB - 1) | st.integers(-(2**31), 2**31 - 1)
        req.prompt_ids.extend(draw(st.lists(ids, max_size=CONTEXT + 10)))
    return req


def must_refuse(req: pb.GenerateRequest) -> bool:
    """The Generate contract, written out independently of the server's code."""
    ids = list(req.prompt_ids)
    temperature = req.temperature if req.HasField("temperature") else 1.0
    return (
        req.model not in ("", "policy")
        or not ids
        or len(ids) + min(max(req.max_tokens, 1), MAX_NEW) > CONTEXT
        or any(not 0 <= i < VOCAB for i in ids)
        or req.max_tokens < 0
        or not (0 <= temperature < math.inf)
    )


@pytest.mark.timeout(240)
@FUZZ
@given(req=generate_request())
def test_generate_fuzz(target: Target, req: pb.GenerateRequest) -> None:
    code, reply = call(target.stub.Generate, req)
    if must_refuse(req):
        assert code == grpc.StatusCode.INVALID_ARGUMENT, (code, reply)
    else:
        assert code == grpc.StatusCode.OK, (code, reply)
        assert isinstance(reply, pb.GenerateReply)
        n = len(reply.completion_ids)
        assert 1 <= n <= min(req.max_tokens or MAX_NEW, MAX_NEW)
        assert len(reply.completion_logprobs) == n
        assert all(math.isfinite(lp) and lp <= 1e-3 for lp in reply.completion_logprobs)
        assert all(0 <= i < VOCAB for i in reply.completion_ids)
        assert reply.model_version == VERSION
    ok = target.stub.Generate(pb.GenerateRequest(model="policy", prompt_ids=[1, 2], max_tokens=1),
                              metadata=bearer(TOKEN), timeout=30)
    assert ok.completion_ids


@pytest.mark.timeout(240)
@FUZZ
@given(data=st.binary(max_size=4096))
def test_generate_garbage_bytes(target: Target, data: bytes) -> None:
    code, reply = call(target.raw_generate, data)
    try:
        req = pb.GenerateRequest.FromString(data)
    except DecodeError:
        assert code == grpc.StatusCode.INVALID_ARGUMENT, (code, reply)
    else:
        assert code == (grpc.StatusCode.INVALID_ARGUMENT if must_refuse(req)
                        else grpc.StatusCode.OK), (code, reply)


# --------------------------------------------------------------------------- afterwards


def test_refusals_counted_and_memory_bounded(target: Target) -> None:
    """Runs last in this module: every kind of refusal is counted, and RSS stayed bounded."""
    call(target.raw_submit, b"\xff\xff\xff")  # one of each, so the counts hold when run alone
    call(target.stub.Submit, pb.SubmitRequest(groups=[pb.TrajectoryGroup()]))
    call(target.stub.Submit, pb.SubmitRequest(groups=[pb.TrajectoryGroup()] * 257))
    call(target.stub.Generate, pb.GenerateRequest(model="policy"))
    st_reply = status(target.stub)
    for reason in ("malformed", "invalid_submit", "too_many_groups", "invalid_generate"):
        assert st_reply.refused_calls[reason] > 0, (reason, dict(st_reply.refused_calls))
    assert st_reply.model_version == VERSION
    grown = psutil.Process(target.pid).memory_info().rss - target.baseline_rss
    assert grown < RSS_GROWTH_BOUND, f"RSS grew {grown >> 20} MiB"
