"""run.tracing (jetctl.tracing): a short real run of builtin:tiny sends its spans to an OTLP
gRPC receiver that runs inside this test (the TraceService of opentelemetry-proto's stubs on
a real grpc server), and one rollout's spans, from the client node, its rollout process and
the server, land in one trace that the optimizer step's span links to. Off, nothing imports
opentelemetry; a wrong `run.tracing` is refused naming the field."""

from __future__ import annotations

import ast
import json
import os
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from concurrent import futures
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import grpc
import pytest
import yaml

from jetctl.recipe import RecipeError, parse_recipe
from tests.runs import ROOT, detached_run

if os.environ.get("CI") != "true":  # under CI the tracing extra is installed: fail, not skip
    pytest.importorskip("opentelemetry.proto", reason="pip install 'jetctl[tracing]'")
from opentelemetry.proto.collector.trace.v1 import (
    trace_service_pb2,
    trace_service_pb2_grpc,
)

RECIPE = """
run:
  name: traced
  duration_s: 600
  tracing: {otlp_endpoint: "127.0.0.1:%(port)d"}
models:
  policy:
    model: builtin:tiny
    finetune: full
    optimizer: {lr: 2.0e-3}
    train: {groups_per_step: 1, max_staleness: 2}  # runs until the test downs it
tasks:
  rows:
    env: jetctl.envs.dataset:make_env
    agent: jetctl.envs.dataset:chat_agent
    model: policy
    clients: 1
    group_size: 4
    sampling: {max_tokens: 4}
    # a reward nearly every group varies in (the digits reward is 0 for most of the untrained
    # model's groups, which are skipped, and the first step waits minutes for one that is not)
    env_args: {path: "%(data)s", reward: "tests.test_tracing:length_mod_3"}
"""


def length_mod_3(completion: str, row: dict[str, Any]) -> float:
    return float(len(completion) % 3) / 2


def write_recipe(folder: Path, port: int) -> Path:
    data = folder / "rows.jsonl"
    data.write_text("".join(json.dumps({"prompt": f"reply with {i}"}) + "\n" for i in range(40)))
    recipe = folder / "traced.yaml"
    recipe.write_text(RECIPE % {"port": port, "data": data})
    return recipe


@dataclass(frozen=True)
class Span:
    service: str  # service.name of the process that sent it
    name: str
    trace_id: bytes
    span_id: bytes
    parent_id: bytes  # b"": a root
    links: tuple[tuple[bytes, bytes], ...]  # (trace id, span id) of each link
    attributes: dict[str, str]


class Receiver(trace_service_pb2_grpc.TraceServiceServicer):
    """An OTLP gRPC collector that keeps every span it is sent."""

    def __init__(self) -> None:
        self.spans: list[Span] = []
        self._lock = threading.Lock()

    def Export(  # the generated servicer's method name
        self, request: trace_service_pb2.ExportTraceServiceRequest, context: grpc.ServicerContext
    ) -> trace_service_pb2.ExportTraceServiceResponse:
        got = []
        for rs in request.resource_spans:
            service = next((a.value.string_value for a in rs.resource.attributes
                            if a.key == "service.name"), "")
            for ss in rs.scope_spans:
                got += [Span(service, s.name, s.trace_id, s.span_id, s.parent_span_id,
                             tuple((k.trace_id, k.span_id) for k in s.links),
                             {a.key: a.value.string_value for a in s.attributes})
                        for s in ss.spans]
        with self._lock:
            self.spans += got
        return trace_service_pb2.ExportTraceServiceResponse()

    def snapshot(self) -> list[Span]:
        with self._lock:
            return list(self.spans)


@pytest.fixture()
def receiver() -> Iterator[tuple[Receiver, int]]:
    server = grpc.server(futures.ThreadPoolExecutor(max_workers=4))
    found = Receiver()
    trace_service_pb2_grpc.add_TraceServiceServicer_to_server(found, server)
    port = server.add_insecure_port("127.0.0.1:0")
    server.start()
    yield found, port
    server.stop(grace=None)


def joined_rollout(spans: list[Span]) -> tuple[Span, dict[str, list[Span]]] | None:
    """The step span and, by name, the spans of a rollout it links to whose whole story has
    arrived (None while none has)."""
    by_id = {s.span_id: s for s in spans}
    for step in (s for s in spans if s.name == "jetctl.optimizer_step"):
        for trace_id, span_id in step.links:
            rollout = by_id.get(span_id)
            if rollout is None or rollout.trace_id != trace_id:
                continue
            named: dict[str, list[Span]] = {}
            for s in spans:
                if s.trace_id == trace_id:
                    named.setdefault(s.name, []).append(s)
            if {"jetctl.generate.server", "jetctl.agent", "jetctl.submit",
                    "jetctl.admission"} <= set(named):
                return step, named
    return None


@pytest.mark.integration
@pytest.mark.timeout(600)
def test_one_rollout_is_one_trace_across_processes_linked_from_its_step(
    receiver: tuple[Receiver, int], tmp_path: Path
) -> None:
    found, port = receiver
    recipe = write_recipe(tmp_path, port)
    with detached_run(recipe, tmp_path / "run"):
        deadline = time.monotonic() + 300
        while (joined := joined_rollout(found.snapshot())) is None:
            assert time.monotonic() < deadline, (
                f"no trained rollout's trace arrived whole in 300 s: "
                f"{sorted({(s.service, s.name) for s in found.snapshot()})}"
            )
            time.sleep(1)
    step, named = joined
    (rollout,) = named["jetctl.rollout"]
    assert (rollout.trace_id, rollout.span_id) in step.links
    assert rollout.service == "jetctl-client" and step.service == "jetctl-server"
    assert rollout.parent_id == b""  # the rollout is the trace's root
    # each model call -> its Generate RPC on the client -> the server's handler
    calls = {s.span_id: s for s in named["jetctl.model_call"]}
    assert calls and all(c.parent_id == rollout.span_id for c in calls.values())
    rpcs = {s.span_id: s for s in named["jetctl.generate"]}
    assert rpcs and all(r.parent_id in calls and r.service == "jetctl-client"
                        for r in rpcs.values())
    served = named["jetctl.generate.server"]
    assert served and all(s.parent_id in rpcs and s.service == "jetctl-server" for s in served)
    # the rollout process's steps, the Submit and the verdict hang off the rollout
    for name, service in (("jetctl.env.open", "jetctl-rollout"), ("jetctl.agent", "jetctl-rollout"),
                          ("jetctl.env.reward", "jetctl-rollout"),
                          ("jetctl.submit", "jetctl-client"),
                          ("jetctl.admission", "jetctl-server")):
        assert named[name] and all(s.parent_id == rollout.span_id and s.service == service
                                   for s in named[name]), (name, named.get(name))
    assert {s.attributes["jetctl.outcome"] for s in named["jetctl.admission"]} == {"accepted"}
    # the env steps the agent took (the dataset env's session.answer) hang off the agent
    agents = {s.span_id for s in named["jetctl.agent"]}
    steps = named.get("jetctl.env.step", [])
    assert steps and all(s.parent_id in agents and s.service == "jetctl-rollout" for s in steps)
    assert {s.attributes["jetctl.env.method"] for s in steps} == {"answer"}


class _Session:
    def __init__(self) -> None:
        self.answers: list[str] = []

    def answer(self, text: str) -> str:
        self.answers.append(text)
        return "ok"

    async def look(self) -> str:
        return "a room"

    def fail(self) -> None:
        raise KeyError("no such tool")

    def reward(self) -> float:
        return float(len(self.answers))

    def close(self) -> None:
        pass


def test_an_env_sessions_steps_are_timed_in_the_order_the_agent_took_them() -> None:
    """`record_env_steps` wraps the session's own public methods on the instance: each call is
    one step with its method and times (an error's type too), the session stays what it was,
    and reward/close are not steps. A frozen session is left as it is."""
    import asyncio
    import dataclasses

    from jetctl.tracing import record_env_steps

    t0 = time.monotonic()
    session = _Session()
    steps = record_env_steps(session, t0)
    assert session.answer("4") == "ok" and asyncio.run(session.look()) == "a room"
    with pytest.raises(KeyError):
        session.fail()
    assert session.reward() == 1.0 and isinstance(session, _Session)
    session.close()
    assert [(s.method, s.error) for s in steps] == [("answer", ""), ("look", ""),
                                                    ("fail", "KeyError")]
    assert all(0 <= s.start_s <= s.end_s <= time.monotonic() - t0 for s in steps)

    @dataclasses.dataclass(frozen=True)
    class Frozen:
        def answer(self, text: str) -> str:
            return text

    frozen = Frozen()
    assert record_env_steps(frozen, t0) == [] and frozen.answer("x") == "x"


def _otel_modules(code: str) -> list[str]:
    """The opentelemetry modules loaded after `code` runs in a fresh interpreter, off."""
    code += "\nimport sys; print(sorted(m for m in sys.modules if m.startswith('opentelemetry')))"
    env = {k: v for k, v in os.environ.items() if k != "JETCTL_OTLP_ENDPOINT"}
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, env=env, capture_output=True,
                         text=True, timeout=120, check=True)
    return list(ast.literal_eval(out.stdout.strip().splitlines()[-1]))


def test_off_nothing_imports_opentelemetry() -> None:
    assert _otel_modules("import jetctl.tracing") == []
    hooks = (
        "import jetctl.client.node, jetctl.server.service\n"
        "from jetctl import tracing\n"
        "assert not tracing.start('x', 'y')\n"
        "tracing.open_rollout('r'); tracing.close_rollout('r')\n"
        "assert tracing.carrier('r') == {} and tracing.traceparent('r') == ''\n"
        "with tracing.generate_call() as md: assert md == ()\n"
        "tracing.optimizer_step(1, [], 0.1)\n"
    )
    # fastapi (the proxy's) imports the opentelemetry API itself when it is installed; the
    # SDK and the exporter, what tracing costs, stay out
    assert [m for m in _otel_modules(hooks)
            if m.startswith(("opentelemetry.sdk", "opentelemetry.exporter"))] == []


GOOD = {
    "run": {"name": "t"},
    "models": {"policy": {"model": "builtin:tiny"}},
    "tasks": {"digits": {"env": "envs.digits:make_env", "agent": "agents.digits:agent",
                         "model": "policy"}},
}


@pytest.mark.parametrize(("tracing", "message"), [
    ({"endpoint": "localhost:4317"}, ("run.tracing.endpoint = 'localhost:4317': unknown key; "
                                     "did you mean 'otlp_endpoint'?")),
    ({"otlp_endpoint": "localhost"}, "run.tracing.otlp_endpoint = 'localhost': is not host:port"),
    ("localhost:4317", "run.tracing"),
])
def test_a_wrong_tracing_field_is_refused_naming_it(tracing: object, message: str) -> None:
    data = {**GOOD, "run": {"name": "t", "tracing": tracing}}
    with pytest.raises(RecipeError) as caught:
        parse_recipe(yaml.safe_dump(data), file="r.yaml", env={})
    assert message in str(caught.value)

