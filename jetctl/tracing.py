"""OpenTelemetry traces of rollouts: one trace per rollout, across the client and server.

With `run.tracing: {otlp_endpoint: host:4317}` the controller hands every process it starts
the collector's address (`JETCTL_OTLP_ENDPOINT`, `environment`); each process calls `start`
once, and the hooks at the call sites record:

    jetctl.rollout                  client node: from the proxy opening the rollout to its close
      jetctl.model_call             client proxy: one per chat completion
        jetctl.generate             client transport: the Generate RPC (the W3C `traceparent`
          jetctl.generate.server    rides in its gRPC metadata): the server's handler
      jetctl.env.open / jetctl.agent / jetctl.env.reward    the rollout process
        jetctl.env.step             the rollout process: each call the agent made to a method
                                    of its env session (`jetctl.env.method`), under the agent
      jetctl.submit                 client transport: each Submit that carried the trajectory
      jetctl.admission              server: the group's verdict (outcome and reason)
    jetctl.optimizer_step           server: a trace of its own, with a span link to the
                                    rollout span of every trajectory it trained

A trajectory carries its rollout's span context as `metadata["traceparent"]`, so a group
carries it through the spool, Submit, the store and the trainer to the step that trains it.

Off (no endpoint) every hook is one test of `_active` and opentelemetry is never imported:
`pip install 'jetctl[tracing]'` only where traces are wanted. On, spans go out in batches
from a worker thread (`BatchSpanProcessor`); the rollout process flushes its three spans,
within `CHILD_FLUSH_MS`, before it hands its result back.

The rollout process records open / agent / reward from its timings and, traced, times each
call of a public method of the env's session (`record_env_steps`: the session's own methods,
wrapped on the instance, so `isinstance` and attributes are untouched; not `reward`, `close`
or `cost`; the first `MAX_ENV_STEPS` calls). A session whose instance takes no attributes
(`__slots__`, a frozen dataclass) is traced without its steps. A node or server started by
hand, without a controller, traces only when its environment names the collector itself.
"""

from __future__ import annotations

import asyncio
import contextlib
import contextvars
import functools
import inspect
import os
import time
from collections import OrderedDict
from collections.abc import Coroutine, Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, TypeVar

T = TypeVar("T")
ENDPOINT_ENV = "JETCTL_OTLP_ENDPOINT"
TRACEPARENT = "traceparent"  # W3C Trace Context: the metadata key on trajectories and RPCs
KEEP_ROLLOUTS = 4096  # span contexts of recent rollouts kept for their trajectories' metadata
EXPORT_DELAY_MS = 500  # a batch of spans goes out at least this often
CHILD_FLUSH_MS = 2000  # the most a rollout process waits for its spans to go out
MAX_ENV_STEPS = 256  # env step spans a rollout records at most
NOT_STEPS = frozenset({"reward", "close", "cost"})  # session methods that are not its steps


def environment(otlp_endpoint: str | None) -> dict[str, str]:
    """What a process the controller starts needs in its environment to trace."""
    return {ENDPOINT_ENV: otlp_endpoint} if otlp_endpoint else {}


@dataclass
class _Tracing:
    """This process's tracer and the rollouts open on it (a client node)."""

    tracer: Any  # opentelemetry.trace.Tracer
    provider: Any  # opentelemetry.sdk.trace.TracerProvider
    rollouts: dict[str, Any] = field(default_factory=dict)  # rollout id -> its open span
    # rollout id -> traceparent, open or closed (its trajectories are built after the close)
    parents: OrderedDict[str, str] = field(default_factory=OrderedDict)


# The OpenTelemetry provider is per process whatever we do; this is the one switch beside it.
_active: _Tracing | None = None


def start(service: str, instance: str) -> bool:
    """Trace this process if its environment names a collector (True if it does)."""
    global _active
    endpoint = os.environ.get(ENDPOINT_ENV, "")
    if _active is not None or not endpoint:
        return _active is not None
    try:
        from opentelemetry.exporter.otlp.proto.grpc.trace_exporter import OTLPSpanExporter
        from opentelemetry.sdk.resources import Resource
        from opentelemetry.sdk.trace import TracerProvider
        from opentelemetry.sdk.trace.export import BatchSpanProcessor
    except ImportError as e:
        raise RuntimeError(
            f"{ENDPOINT_ENV}={endpoint} asks for traces, but {e.name} is not installed: "
            "pip install 'jetctl[tracing]'"
        ) from e
    resource = Resource.create({"service.name": service, "service.instance.id": instance})
    provider = TracerProvider(resource=resource)
    exporter = OTLPSpanExporter(endpoint=endpoint, insecure=not endpoint.startswith("https://"))
    provider.add_span_processor(BatchSpanProcessor(exporter, schedule_delay_millis=EXPORT_DELAY_MS))
    _active = _Tracing(tracer=provider.get_tracer("jetctl"), provider=provider)
    return True


def flush(timeout_ms: int = CHILD_FLUSH_MS) -> None:
    if _active is not None:
        _active.provider.force_flush(timeout_ms)


def _context(traceparent: str) -> Any:
    from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator

    return TraceContextTextMapPropagator().extract({TRACEPARENT: traceparent})


def _traceparent(span: Any) -> str:
    from opentelemetry import trace
    from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator

    carrier: dict[str, str] = {}
    TraceContextTextMapPropagator().inject(carrier, trace.set_span_in_context(span))
    return carrier.get(TRACEPARENT, "")


# --------------------------------------------------------------------------- client node


def open_rollout(rollout_id: str) -> None:
    """The rollout's span starts (the proxy opens its timeline)."""
    if _active is None:
        return
    span = _active.tracer.start_span("jetctl.rollout", attributes={"jetctl.rollout_id": rollout_id})
    _active.rollouts[rollout_id] = span
    _active.parents[rollout_id] = _traceparent(span)
    while len(_active.parents) > KEEP_ROLLOUTS:
        _active.parents.popitem(last=False)


def close_rollout(rollout_id: str) -> None:
    if _active is not None and (span := _active.rollouts.pop(rollout_id, None)) is not None:
        span.end()


def traceparent(rollout_id: str) -> str:
    """The rollout span's context as W3C text ("" when off or unknown)."""
    return "" if _active is None else _active.parents.get(rollout_id, "")


def carrier(rollout_id: str) -> dict[str, str]:
    """What a trajectory of the rollout records in its metadata ({} when off)."""
    parent = traceparent(rollout_id)
    return {TRACEPARENT: parent} if parent else {}


def model_call(rollout_id: str, model: str, call: Coroutine[Any, Any, T]) -> asyncio.Task[T]:
    """The proxy's task for one chat completion's backend call; traced, it runs inside a
    `jetctl.model_call` span of the rollout (ended when the task is done), so the Generate
    calls it makes are the span's children."""
    if _active is None or rollout_id not in _active.rollouts:
        return asyncio.get_running_loop().create_task(call)
    from opentelemetry import context as otel_context
    from opentelemetry import trace

    parent = trace.set_span_in_context(_active.rollouts[rollout_id])
    span = _active.tracer.start_span(
        "jetctl.model_call", context=parent, attributes={"jetctl.model": model}
    )
    context = contextvars.copy_context()
    context.run(otel_context.attach, trace.set_span_in_context(span))
    task = asyncio.get_running_loop().create_task(call, context=context)
    task.add_done_callback(lambda _: span.end())
    return task


@contextlib.contextmanager
def generate_call() -> Iterator[tuple[tuple[str, str], ...]]:
    """The client's span of one Generate RPC; yields the metadata that carries it."""
    if _active is None:
        yield ()
        return
    from opentelemetry import trace

    if not trace.get_current_span().get_span_context().is_valid:  # not in a rollout
        yield ()
        return
    with _active.tracer.start_as_current_span("jetctl.generate", kind=trace.SpanKind.CLIENT) as s:
        yield ((TRACEPARENT, _traceparent(s)),)


@contextlib.contextmanager
def submit_call(groups: Sequence[Any]) -> Iterator[None]:
    """A `jetctl.submit` span in the trace of each trajectory of a Submit, open while it runs."""
    if _active is None:
        yield
        return
    spans = _child_spans("jetctl.submit", _parents(groups), {"jetctl.groups": len(groups)})
    try:
        yield
    finally:
        for span in spans:
            span.end()


@dataclass(frozen=True)
class EnvStep:
    """One call of an env session's method: seconds since the rollout's t0."""

    method: str
    start_s: float
    end_s: float
    error: str = ""  # the exception's type, when the call raised


def record_env_steps(session: Any, t0: float) -> list[EnvStep]:
    """Time each call of `session`'s public methods (see the module docstring) into the list
    returned, as the agent makes them; `t0`: time.monotonic() at the rollout's start."""
    steps: list[EnvStep] = []
    seen: set[str] = set()
    for klass in type(session).__mro__:
        if klass is object or klass.__module__ in ("typing", __name__, "jetctl.env"):
            continue
        for name, attr in vars(klass).items():
            if name in seen or name.startswith("_") or name in NOT_STEPS:
                continue
            seen.add(name)
            if not inspect.isfunction(attr):  # properties, static and class methods stay
                continue
            try:
                setattr(session, name, _timed(getattr(session, name), name, steps, t0))
            except (AttributeError, TypeError):  # __slots__, frozen: traced without its steps
                return steps
    return steps


def _timed(method: Any, name: str, steps: list[EnvStep], t0: float) -> Any:
    def note(start: float, error: BaseException | None) -> None:
        if len(steps) < MAX_ENV_STEPS:
            steps.append(EnvStep(name, start - t0, time.monotonic() - t0,
                                 "" if error is None else type(error).__name__))

    if inspect.iscoroutinefunction(method):
        @functools.wraps(method)
        async def timed_async(*args: Any, **kwargs: Any) -> Any:
            start = time.monotonic()
            try:
                out = await method(*args, **kwargs)
            except BaseException as e:
                note(start, e)
                raise
            note(start, None)
            return out

        return timed_async

    @functools.wraps(method)
    def timed(*args: Any, **kwargs: Any) -> Any:
        start = time.monotonic()
        try:
            out = method(*args, **kwargs)
        except BaseException as e:
            note(start, e)
            raise
        note(start, None)
        return out

    return timed


def rollout_process(
    traceparent: str, t0: float, timings: Mapping[str, float], steps: Sequence[EnvStep] = ()
) -> None:
    """In the rollout process, before it hands its result back: its phases as spans from its
    timings (`t0`: time.monotonic() at its start) and its env steps under the agent's span,
    flushed now, as the process ends next."""
    if not traceparent or not start("jetctl-rollout", str(os.getpid())):
        return
    assert _active is not None
    from opentelemetry import trace

    parent = _context(traceparent)
    now_ns, elapsed_s = time.time_ns(), time.monotonic() - t0

    def at(offset_s: float) -> int:  # an offset since t0 as a wall-clock time in ns
        return now_ns - int((elapsed_s - offset_s) * 1e9)

    at_s = 0.0  # since t0; the phases ran one after the other
    for name, key in (("jetctl.env.open", "open_s"), ("jetctl.agent", "agent_s"),
                      ("jetctl.env.reward", "reward_s")):
        if key not in timings:
            break
        begin = at(at_s)
        at_s += timings[key]
        span = _active.tracer.start_span(name, context=parent, start_time=begin)
        span.end(end_time=at(at_s))
        if name == "jetctl.agent":
            agent = trace.set_span_in_context(span)
            for step in steps:
                attributes = {"jetctl.env.method": step.method}
                if step.error:
                    attributes["jetctl.env.error"] = step.error
                child = _active.tracer.start_span(
                    "jetctl.env.step", context=agent, start_time=at(step.start_s),
                    attributes=attributes)
                child.end(end_time=at(step.end_s))
    flush()


# --------------------------------------------------------------------------- server


@contextlib.contextmanager
def generate_handler(rpc: Any) -> Iterator[None]:
    """The server's span of a Generate call (`rpc`: its grpc.aio context), a child of the
    caller's span when the call's metadata carries one."""
    if _active is None:
        yield
        return
    from opentelemetry import trace

    parent = next((str(v) for k, v in rpc.invocation_metadata() or () if k == TRACEPARENT), "")
    if not parent:
        yield
        return
    with _active.tracer.start_as_current_span(
        "jetctl.generate.server", context=_context(parent), kind=trace.SpanKind.SERVER
    ):
        yield


def admission(groups: Sequence[Any], acks: Sequence[Any]) -> None:
    """A `jetctl.admission` span in the trace of each trajectory of each judged group;
    `acks[i]` is group i's `Ack` (its outcome and reason)."""
    if _active is None:
        return
    for group, ack in zip(groups, acks):
        outcome = ack.DESCRIPTOR.fields_by_name["code"].enum_type.values_by_number[ack.code].name
        attributes = {"jetctl.group_id": group.id, "jetctl.outcome": outcome.lower(),
                      "jetctl.reason": ack.reason}
        for span in _child_spans("jetctl.admission", _parents([group]), attributes):
            span.end()


def optimizer_step(version: int, groups: Sequence[Any], seconds: float) -> None:
    """The step that trained `groups` (it took `seconds` and made `version`), linked to the
    rollout span of each trajectory."""
    if _active is None:
        return
    from opentelemetry import trace

    links = [trace.Link(trace.get_current_span(_context(p)).get_span_context())
             for p in _parents(groups)]
    now_ns = time.time_ns()
    span = _active.tracer.start_span(
        "jetctl.optimizer_step", links=links, start_time=now_ns - int(seconds * 1e9),
        attributes={"jetctl.version": version, "jetctl.groups": len(groups)},
        context=trace.set_span_in_context(trace.INVALID_SPAN),  # a trace of its own
    )
    span.end(end_time=now_ns)


def _parents(groups: Iterable[Any]) -> list[str]:
    """The rollout span contexts of the groups' trajectories (a protobuf message or a
    dataclass: both have `.trajectories[i].metadata`)."""
    return [p for g in groups for t in g.trajectories if (p := t.metadata.get(TRACEPARENT, ""))]


def _child_spans(name: str, parents: Iterable[str], attributes: dict[str, Any]) -> list[Any]:
    assert _active is not None
    return [_active.tracer.start_span(name, context=_context(p), attributes=attributes)
            for p in parents]
