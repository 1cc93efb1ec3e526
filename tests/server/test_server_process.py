"""A real `jetctl server` process on loopback with builtin:tiny: serve, refuse bad input, train.

Each test talks gRPC to the real process; no mocks. The server is started once per module.
"""

from __future__ import annotations

import json
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import grpc
import pytest

from jetctl.auth import bearer, write_token
from jetctl.proto._gen import swarm_pb2 as pb
from jetctl.proto._gen import swarm_pb2_grpc
from jetctl.proto.convert import group_to_pb
from jetctl.types import LLMCall, Trajectory, TrajectoryGroup, uuid7

pytestmark = [pytest.mark.integration, pytest.mark.timeout(240)]

ROOT = Path(__file__).resolve().parents[2]
TOKEN = "test-token"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[str, Path]]:
    run_dir = tmp_path_factory.mktemp("run")
    write_token(run_dir / "token", TOKEN)
    recipe = run_dir / "recipe.yaml"
    recipe.write_text((ROOT / "recipes" / "tiny.yaml").read_text().replace(
        "max_staleness: 2", "max_staleness: 2\n      max_steps: 1000"
    ) + "\n")
    port = free_port()
    log = (run_dir / "server.log").open("w")
    proc = subprocess.Popen(
        [sys.executable, "-m", "jetctl.cli.main", "server", "--recipe", str(recipe),
         "--model", "policy", "--run-dir", str(run_dir), "--port", str(port)],
        stdout=log, stderr=subprocess.STDOUT, cwd=ROOT,
    )
    endpoint_file = run_dir / "servers" / "policy.json"
    deadline = time.monotonic() + 120
    while not endpoint_file.exists():
        assert proc.poll() is None, (run_dir / "server.log").read_text()
        assert time.monotonic() < deadline, "server did not come up"
        time.sleep(0.2)
    yield json.loads(endpoint_file.read_text())["endpoint"], run_dir
    proc.terminate()
    assert proc.wait(60) == 0, (run_dir / "server.log").read_text()[-3000:]


def stub(endpoint: str, **opts: int) -> swarm_pb2_grpc.SwarmStub:
    channel = grpc.insecure_channel(endpoint, options=list(opts.items()))
    return swarm_pb2_grpc.SwarmStub(channel)


def rollout_group(s: swarm_pb2_grpc.SwarmStub, rewards: list[float]) -> TrajectoryGroup:
    """A group built from real Generate replies."""
    gid = uuid7()
    trajs = []
    for r in rewards:
        prompt = [5, 6, 7, 8]
        rep = s.Generate(pb.GenerateRequest(model="policy", prompt_ids=prompt, max_tokens=4),
                         metadata=bearer(TOKEN), timeout=30)
        call = LLMCall("policy", prompt, list(rep.completion_ids), list(rep.completion_logprobs),
                       rep.model_version, rep.finish_reason)
        trajs.append(Trajectory(id=uuid7(), group_id=gid, task="digits", task_id="t", calls=[call],
                                reward=r, client_revision="r0"))
    return TrajectoryGroup(gid, "digits", "t", "policy", trajs)


def test_register_and_generate(server: tuple[str, Path]) -> None:
    s = stub(server[0])
    reg = s.Register(pb.RegisterRequest(client_id="c", task="digits", model="policy"),
                     metadata=bearer(TOKEN), timeout=10)
    assert reg.model == "policy" and "tokenizer.json" in reg.tokenizer_files
    rep = s.Generate(pb.GenerateRequest(model="policy", prompt_ids=[1, 2, 3], max_tokens=5),
                     metadata=bearer(TOKEN), timeout=30)
    assert 1 <= len(rep.completion_ids) <= 5
    assert len(rep.completion_logprobs) == len(rep.completion_ids)
    assert all(lp <= 0 for lp in rep.completion_logprobs)


def test_refusals_are_counted_and_the_server_keeps_serving(server: tuple[str, Path]) -> None:
    endpoint = server[0]
    s = stub(endpoint, **{"grpc.max_send_message_length": 64 << 20})
    req = pb.SubmitRequest(groups=[group_to_pb(rollout_group(s, [0.0, 1.0]))])
    with pytest.raises(grpc.RpcError) as e:
        s.Submit(req, timeout=10)
    assert e.value.code() == grpc.StatusCode.UNAUTHENTICATED
    with pytest.raises(grpc.RpcError) as e:
        s.Submit(req, metadata=(("authorization", "Bearer wrong"),), timeout=10)
    assert e.value.code() == grpc.StatusCode.UNAUTHENTICATED

    bad = pb.SubmitRequest()
    bad.CopyFrom(req)
    bad.groups[0].model = "nope"
    for t in bad.groups[0].trajectories:
        for c in t.calls:
            c.model = "nope"
    with pytest.raises(grpc.RpcError) as e:
        s.Submit(bad, metadata=bearer(TOKEN), timeout=10)
    assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "not served" in e.value.details()

    channel = grpc.insecure_channel(endpoint)
    raw = channel.unary_unary("/jetctl.swarm.v1.Swarm/Submit")  # no serializer: raw bytes
    with pytest.raises(grpc.RpcError) as e:
        raw(b"\xff\xfe garbage \x00\x01", metadata=bearer(TOKEN), timeout=10)
    assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT

    huge = pb.SubmitRequest()
    huge.CopyFrom(req)
    huge.groups[0].trajectories[0].metadata["blob"] = "x" * (20 << 20)  # > 16 MiB cap
    with pytest.raises(grpc.RpcError) as e:
        s.Submit(huge, metadata=bearer(TOKEN), timeout=30)
    assert e.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED

    reply = s.Submit(req, metadata=bearer(TOKEN), timeout=10)
    assert [a.code for a in reply.acks] == [pb.Ack.ACCEPTED]
    again = s.Submit(req, metadata=bearer(TOKEN), timeout=10)
    assert [a.code for a in again.acks] == [pb.Ack.DUPLICATE]
    st = s.Status(pb.StatusRequest(), metadata=bearer(TOKEN), timeout=10)
    assert st.refused_calls["unauthenticated"] >= 2
    assert st.refused_calls["malformed"] >= 1
    assert st.refused_calls["invalid_submit"] >= 1


def test_trains_and_versions_rise(server: tuple[str, Path]) -> None:
    s = stub(server[0])
    start = s.Status(pb.StatusRequest(), metadata=bearer(TOKEN), timeout=10).model_version
    for _ in range(6):
        g = rollout_group(s, [0.0, 1.0, 0.5, 0.0])
        reply = s.Submit(pb.SubmitRequest(groups=[group_to_pb(g)]), metadata=bearer(TOKEN), timeout=10)
        assert reply.acks[0].code in (pb.Ack.ACCEPTED, pb.Ack.STALE)
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        st = s.Status(pb.StatusRequest(), metadata=bearer(TOKEN), timeout=10)
        if st.model_version >= start + 3:
            break
        time.sleep(0.5)
    assert st.model_version >= start + 3, st
    steps = (server[1] / "metrics" / "policy.steps.jsonl").read_text().splitlines()
    last = json.loads(steps[-1])
    assert last["grad_norm"] > 0 and last["num_tokens"] > 0
    # weights at the new version stream out, verified by sha256
    chunks = list(s.PullWeights(pb.PullWeightsRequest(have_version=-1), metadata=bearer(TOKEN), timeout=30))
    assert chunks and chunks[0].version >= start + 2 and chunks[0].kind == "full"
    assert sum(len(c.data) for c in chunks) == chunks[0].total_bytes
    current = s.Status(pb.StatusRequest(), metadata=bearer(TOKEN), timeout=10).model_version
    if current == chunks[0].version:  # nothing is sent to a client that is up to date
        assert not list(s.PullWeights(pb.PullWeightsRequest(have_version=current),
                                      metadata=bearer(TOKEN), timeout=30))


def train_until(s: swarm_pb2_grpc.SwarmStub, version: int, timeout_s: float = 90) -> int:
    """Submit informative groups made by the current weights until the server reaches
    `version`; returns the version reached."""
    deadline = time.monotonic() + timeout_s
    current = s.Status(pb.StatusRequest(), metadata=bearer(TOKEN), timeout=10).model_version
    while current < version:
        assert time.monotonic() < deadline, f"version stuck at {current}"
        g = rollout_group(s, [0.0, 1.0, 0.5, 0.0])
        s.Submit(pb.SubmitRequest(groups=[group_to_pb(g)]), metadata=bearer(TOKEN), timeout=10)
        time.sleep(0.2)
        current = s.Status(pb.StatusRequest(), metadata=bearer(TOKEN), timeout=10).model_version
    return current


def test_stale_group_is_refused(server: tuple[str, Path]) -> None:
    s = stub(server[0])
    version = train_until(s, 3)  # max_staleness is 2 (recipes/tiny.yaml)
    g = rollout_group(s, [0.0, 1.0])
    for t in g.trajectories:
        for c in t.calls:
            c.model_version = version - 3
    reply = s.Submit(pb.SubmitRequest(groups=[group_to_pb(g)]), metadata=bearer(TOKEN), timeout=10)
    assert reply.acks[0].code == pb.Ack.STALE and "lag" in reply.acks[0].reason


def test_generate_for_a_model_not_served_here_is_refused(server: tuple[str, Path]) -> None:
    s = stub(server[0])
    with pytest.raises(grpc.RpcError) as e:
        s.Generate(pb.GenerateRequest(model="planner", prompt_ids=[1, 2, 3], max_tokens=4),
                   metadata=bearer(TOKEN), timeout=30)
    assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "'planner' is not served here" in e.value.details()
    assert "'policy'" in e.value.details()


def test_the_log_says_each_starting_phase_in_plain_lines(server: tuple[str, Path]) -> None:
    """A server's log is a file: phases as lines, no progress bars redrawn with carriage
    returns, no deprecation notes of the libraries; its last phase is `serving`."""
    run_dir = server[1]
    log = (run_dir / "server.log").read_bytes()
    assert b"\r" not in log and b"FutureWarning" not in log and b"Loading weights" not in log
    text = log.decode()
    order = [text.index(p) for p in ("loading builtin:tiny", "restoring the last checkpoint",
                                     "reloading the buffered groups", "starting the gRPC service",
                                     "serving policy on")]
    assert order == sorted(order), text[:2000]
    phase = json.loads((run_dir / "server-policy" / "phase.json").read_text())
    pid = json.loads((run_dir / "servers" / "policy.json").read_text())["pid"]
    assert (phase["phase"], phase["pid"]) == ("serving", pid)
