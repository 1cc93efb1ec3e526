"""A swarm server process: one trainable model, its engine, store, trainer and gRPC service.

Run: `jetctl server --model M --run-dir D --port P` with `JETCTL_CONTROL` set (the
controller does this; by hand on any host: `jetctl server --join ADDR --token T --model M`),
or `jetctl server --recipe R --model M --run-dir D` without a controller (benchmarks).
With a controller the server gets its settings from `Control.Join` and syncs about once a
second (jetctl.link): its advertised endpoint, the revisions it refuses and its store's
ledger records (jetctl.journal) go to the controller; the revisions to refuse come back.
Setup -> serve -> cleanup, as `serve` reads: `build` loads the model (LoRA-wrapped or
full), resumes from the last complete checkpoint, reloads accepted-but-untrained groups,
serves gRPC (+ health and reflection) and Prometheus /metrics and trains in a thread (and
runs the tasks' in-run evals after due checkpoints, jetctl/server/evals.py); `run` serves
until SIGTERM or the controller's drain; `drain` stops accepting (health NOT_SERVING),
finishes the current step, checkpoints, exits 0.

Each phase of the start is logged as it begins (and written to `phase.json` for the live
view); once serving, one line says where the start's time went, from the process's start:
`started in <s>: before serve() <s> (interpreter, imports, joining), loading <model> <s>,
restoring the last checkpoint <s>, ..., preparing the hf engine <s>, ...`. The controller
starts the task's client nodes at the same time (jetctl/controller/reconcile.py), so a
client's rollouts run while these phases do.
"""

from __future__ import annotations

import asyncio
import logging
import os
import signal
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection

from jetctl import auth
from jetctl.faults import Faults, drop_ack_interceptor
from jetctl.journal import STORE_TABLES, Journal
from jetctl.link import ControlLink, Identity
from jetctl.net import LISTEN_ALSO_ENV, advertised_host, listen_also
from jetctl.proctree import process_create_time
from jetctl.recipe import LimitsConfig, ModelConfig
from jetctl.revisions import read_refused, write_refused
from jetctl.rundir import RunPaths, write_json_atomic
from jetctl.server.admission import Limits
from jetctl.server.checkpoint import CHECKPOINT_KEY, SignedDir
from jetctl.server.engines import Engine, ServingEngine, make_engine
from jetctl.server.evals import InRunEval
from jetctl.server.locks import WeightsLock
from jetctl.server.metrics import ServerMetrics
from jetctl.server.service import SERVICE, SwarmService, auth_interceptor
from jetctl.server.step import load_trainable
from jetctl.server.store import TrajectoryStore
from jetctl.server.trainer import Trainer
from jetctl.tls import TlsFiles, add_port
from jetctl.trackers import Trackers, TrackingPlan

if TYPE_CHECKING:
    from wsgiref.simple_server import WSGIServer

log = logging.getLogger("jetctl.server")
STALL_TIMEOUT_S = 900.0  # a step or generation batch running longer is a hang


@dataclass
class ServerOptions:
    name: str
    cfg: ModelConfig
    run_dir: Path
    token: str
    port: int
    metrics_port: int = 0
    train: bool = True  # False: serve and store only (benchmarks)
    tls: TlsFiles | None = None  # run.tls; None: plaintext
    link: ControlLink | None = None  # the controller; None: a server on its own
    tracking: TrackingPlan | None = None  # run.trackers; None: the step log only


def open_store(path: Path, cfg: ModelConfig) -> TrajectoryStore:
    """The model's trajectory store, its buffer bounded by the recipe's limits."""
    return TrajectoryStore(
        path, max_buffer_groups=cfg.limits.max_buffer_groups,
        max_buffer_bytes=cfg.limits.max_buffer_bytes,
    )


def grpc_server(
    limits: LimitsConfig, interceptors: list[grpc.aio.ServerInterceptor]
) -> grpc.aio.Server:
    """The gRPC server of the Swarm service, bounded by the recipe's `limits:`: message
    sizes both ways, and the RPCs it runs at once (`max_concurrent_rpcs`, a backstop above
    Generate's own bound, `max_queued_generates`, which answers first and with a
    retry-after; past this one every call gets RESOURCE_EXHAUSTED at once)."""
    return grpc.aio.server(
        interceptors=interceptors,
        maximum_concurrent_rpcs=limits.max_concurrent_rpcs,
        options=[
            ("grpc.max_receive_message_length", limits.max_message_bytes),
            ("grpc.max_send_message_length", limits.max_message_bytes),
            ("grpc.keepalive_time_ms", 20_000),
            ("grpc.keepalive_timeout_ms", 10_000),
            ("grpc.http2.min_ping_interval_without_data_ms", 5_000),
            # clients ping every 10 s, also when idle; allow it
            ("grpc.http2.min_recv_ping_interval_without_data_ms", 5_000),
            ("grpc.keepalive_permit_without_calls", 1),
            ("grpc.http2.max_ping_strikes", 0),
        ],
    )


def cpu_threads(cfg: ModelConfig) -> tuple[int, int]:
    """(generation, training) torch CPU threads: the recipe's, or this host's cores split in
    two, since the engine and the trainer compute at the same time. Two torch thread pools
    that each take every core made each several times slower on a 2-core host."""
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (
        os.cpu_count() or 1)
    gen = cfg.generation.threads or max(1, cores // 2)
    train = cfg.train.threads or max(1, cores - gen)
    return gen, train


def lending(cfg: ModelConfig, trainer: Trainer, train_threads: int) -> Callable[[], int] | None:
    """`train.lend_threads`: how many CPU threads the engine may borrow right now (the
    trainer's, while it computes no step); None when the recipe lends none."""
    if not cfg.train.lend_threads:
        return None
    return lambda: 0 if trainer.computing else train_threads


@dataclass
class Server:
    """A server `build` made, serving: what `run` watches and `drain` stops, in that order."""

    opts: ServerOptions
    trainer: Trainer
    engine: Engine
    store: TrajectoryStore
    journal: Journal  # the store's ledger records, synced to the controller
    trackers: Trackers | None
    evals: InRunEval | None
    service: SwarmService
    rpc: grpc.aio.Server
    health_servicer: health.aio.HealthServicer
    httpd: WSGIServer  # Prometheus /metrics
    host: str  # advertised
    endpoint: str  # host:port of the gRPC service
    metrics_endpoint: str  # host:port of /metrics
    stop: asyncio.Event = field(default_factory=asyncio.Event)  # set: drain


async def serve(opts: ServerOptions) -> int:
    """Setup -> serve -> cleanup. The exit code: 1 when the trainer failed, else 0 (a hang
    exits 70 from `run`, at once)."""
    server = await build(opts)
    await run(server)
    await drain(server)
    return 1 if server.trainer.error is not None else 0


async def build(opts: ServerOptions) -> Server:
    """Every part of the server, each phase logged as it begins (`StartingPhase`), up to
    serving: the gRPC service and /metrics bound, the engine running, the trainer too (with
    `opts.train`), health SERVING and the endpoint file written."""
    import torch

    cfg = opts.cfg
    gen_threads, train_threads = cpu_threads(cfg)
    torch.set_num_threads(gen_threads + train_threads)  # loading; each worker sets its own
    paths = RunPaths(opts.run_dir)
    paths.server_dir(opts.name).mkdir(parents=True, exist_ok=True)
    # signed with a key of this server's own folder, which no client container mounts
    ckpt_dir = SignedDir(
        cfg.checkpoint.dir or str(paths.checkpoints(opts.name)),  # or a URL
        auth.private_key(paths.server_dir(opts.name) / CHECKPOINT_KEY),
    )

    t0 = time.monotonic()
    phase = StartingPhase(paths.server_phase(opts.name))
    phase(f"loading {cfg.model}")
    check_devices(opts.name, cfg)
    # a builtin built on first use (SmolLM2: download, dequantize, save) reports each step
    model, tokenizer = load_trainable(cfg, progress=phase)
    metrics = ServerMetrics()
    lock = WeightsLock()
    faults = Faults.from_env()  # off unless JETCTL_FAULTS / JETCTL_FAULTS_FILE say (chaos)
    store = open_store(paths.store(opts.name), cfg)
    journal = Journal.install(store.path, STORE_TABLES)  # before the store writes anything
    trackers = None if opts.tracking is None else Trackers.open(
        opts.tracking, model=opts.name, run_dir=opts.run_dir, decode=tokenizer.decode,
    )
    trainer = Trainer(
        model, cfg, store, weights_lock=lock, checkpoint_dir=ckpt_dir,
        steps_log=paths.steps_log(opts.name), on_step=metrics.on_step,
        faults=faults, threads=train_threads, trackers=trackers,
    )
    phase("restoring the last checkpoint")
    version = trainer.resume()
    phase("reloading the buffered groups")
    buffered = store.open(trained_through_step=version)
    metrics.model_version.set(version)
    log.info("model %s loaded in %.1fs at version %d, %d groups buffered",
             cfg.model, time.monotonic() - t0, version, buffered)

    eos_ids, pad = _eos_and_pad(tokenizer)
    phase(f"preparing the {cfg.engine} engine")
    serving = make_engine(
        cfg, model, eos_token_ids=eos_ids, pad_token_id=pad, weights_lock=lock,
        version=lambda: trainer.version,
        on_batch=lambda n, _tok, _s: metrics.generate_batch_size.observe(n),
        threads=gen_threads,
        lent_threads=lending(cfg, trainer, train_threads),
    )
    _log_engine(cfg, serving)
    # tasks' `eval: {every_steps: N}`: `jetctl eval` in a child after each due checkpoint
    evals = InRunEval.for_server(opts.run_dir, opts.name, version) if opts.train else None
    # the engine starts at the restored version (a replica copies the restored weights), so
    # it is built after the trainer, which gets its hooks here
    trainer.attach_engine(serving.publish, _step_figures(serving.engine, evals))
    if evals is not None:
        evals.start()
    phase("preparing the service")
    service = _swarm_service(opts, model, tokenizer, serving.engine, store, trainer, metrics,
                             eos_ids)
    rpc, health_servicer = _grpc_service(opts, service, faults)
    phase("starting the gRPC service")
    port = _bind(rpc, opts)
    await rpc.start()
    serving.engine.start()

    from prometheus_client import start_http_server

    httpd, _ = start_http_server(opts.metrics_port, addr=cfg.host, registry=metrics.registry)
    metrics_port = httpd.server_port

    if opts.train:
        trainer.start()
    await health_servicer.set("", health_pb2.HealthCheckResponse.SERVING)
    await health_servicer.set(SERVICE, health_pb2.HealthCheckResponse.SERVING)
    host = advertised_host(cfg.host, cfg.advertise, opts.link.endpoint_address if opts.link else "")
    endpoint, metrics_endpoint = f"{host}:{port}", f"{host}:{metrics_port}"
    # a restart refuses what it refused before, also while the controller is unreachable
    service.refused_revisions = read_refused(opts.run_dir, opts.name)
    if opts.link is not None:
        service.refused_revisions |= opts.link.refused
    _write_endpoint(opts, endpoint, metrics_endpoint, trainer.version, service.refused_revisions)
    log.info("serving %s on %s:%d, advertised as %s (metrics :%d)", opts.name, cfg.host, port,
             endpoint, metrics_port)
    phase("serving")
    log.info("%s", phase.summary())
    return Server(
        opts=opts, trainer=trainer, engine=serving.engine, store=store, journal=journal,
        trackers=trackers, evals=evals, service=service, rpc=rpc,
        health_servicer=health_servicer, httpd=httpd, host=host, endpoint=endpoint,
        metrics_endpoint=metrics_endpoint,
    )


async def run(server: Server) -> None:
    """Serve until SIGTERM or SIGINT, the controller's drain, or a failed trainer. Each tick
    (1 s with a controller, else 2 s): the watchdog, the due evals, a sync with the
    controller and the endpoint file."""
    opts, trainer = server.opts, server.trainer
    await _sync(server)

    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, server.stop.set)
    tick_s = 1.0 if opts.link is not None else 2.0
    while not server.stop.is_set():
        try:
            await asyncio.wait_for(server.stop.wait(), timeout=tick_s)
        except asyncio.TimeoutError:
            pass
        if trainer.error is not None:
            log.error("trainer failed: %r", trainer.error)
            break
        stalled = _stalled(trainer.busy_since, server.engine.busy_since, STALL_TIMEOUT_S)
        if stalled:
            # a hang is a loud error, never a silent stall: die like a crash (everything
            # acked is durable) and let the controller restart from the last checkpoint
            log.critical("%s; exiting so the controller restarts this server", stalled)
            os._exit(70)
        if server.evals is not None:
            server.evals.checkpointed(trainer.figures.last_checkpoint_version)
        await _sync(server)
        _write_endpoint(opts, server.endpoint, server.metrics_endpoint, trainer.version,
                        server.service.refused_revisions)


async def drain(server: Server) -> None:
    """The ordered stop: health NOT_SERVING (no new calls), the current step finished and
    checkpointed, the trackers flushed, then the gRPC service (5 s of grace), the engine,
    the store and /metrics; the last sync and the link last."""
    log.info("draining: finishing the current step and checkpointing")
    await server.health_servicer.enter_graceful_shutdown()
    if server.evals is not None:  # a running eval is killed: its cores go to the last step
        await asyncio.to_thread(server.evals.stop)
    await asyncio.to_thread(server.trainer.stop)
    if server.trackers is not None:
        await asyncio.to_thread(server.trackers.close)
    await server.rpc.stop(grace=5.0)
    await server.engine.stop()
    server.store.close()
    server.httpd.shutdown()
    try:  # the last ledger records (steps trained while draining), best effort
        await asyncio.wait_for(_sync(server, final=True), timeout=10.0)
    except asyncio.TimeoutError:
        log.warning("last sync with the controller timed out")
    if server.opts.link is not None:
        await server.opts.link.close()


async def _sync(server: Server, final: bool = False) -> None:
    """Tell the controller where this server is, what it refuses, what its store did; take
    back the revisions to refuse, the revoked nodes and a request to drain."""
    opts, service = server.opts, server.service
    if opts.link is None:
        # swap-clients --drop-old without a controller: the file (jetctl/revisions.py)
        service.refused_revisions = read_refused(opts.run_dir, opts.name)
        return
    status = {"state": "exited" if final else "running", "version": server.trainer.version,
              "pid": os.getpid(), "address": server.host}
    reply = await opts.link.sync(
        Identity(name=f"server-{opts.name}", kind="server", model=opts.name),
        status=status, journal=server.journal, endpoint=server.endpoint,
        metrics=server.metrics_endpoint, refused=service.refused_revisions, final=final,
    )
    if reply is not None and not final:
        refused = frozenset(reply.refused_revisions)
        if refused != service.refused_revisions:
            write_refused(opts.run_dir, opts.name, refused)  # for a restart
            service.refused_revisions = refused
        service.revoked_nodes = frozenset(reply.revoked_nodes)
        if reply.drain and not server.stop.is_set():
            log.info("%s", reply.message or "the controller asked this server to stop")
            server.stop.set()  # as on SIGTERM: finish the step, checkpoint, exit


def _eos_and_pad(tokenizer: Any) -> tuple[list[int], int]:
    """The tokenizer's end-of-sequence ids, and its pad id (else the first of those)."""
    eos = tokenizer.eos_token_id
    eos_ids = [eos] if isinstance(eos, int) else list(eos or [])
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else eos_ids[0]
    return eos_ids, pad


def _log_engine(cfg: ModelConfig, serving: ServingEngine) -> None:
    """What the engine generates on, in which dtype, and why."""
    gen = cfg.generation
    log.info("engine %s generates %s; dtype: %s", cfg.engine,
             "on the trainer's model" if serving.publish is None else
             f"on its own copy ({serving.dtype.dtype or cfg.dtype} on "
             f"{gen.device or cfg.device}), refreshed after each optimizer step",
             serving.dtype.why)


def _step_figures(
    engine: Engine, evals: InRunEval | None
) -> Callable[[], dict[str, float]] | None:
    """More figures for each step row: the engine's (`take_figures`, when it has one) and
    the in-run evals'."""
    take_figures: Callable[[], dict[str, float]] | None = getattr(engine, "take_figures", None)
    return take_figures if evals is None else evals.joined(take_figures)


def _swarm_service(
    opts: ServerOptions, model: Any, tokenizer: Any, engine: Engine, store: TrajectoryStore,
    trainer: Trainer, metrics: ServerMetrics, eos_ids: list[int],
) -> SwarmService:
    """The Swarm service over the built parts, bounded by the recipe's `limits:`."""
    from jetctl.models import tokenizer_files

    cfg = opts.cfg
    vocab = int(model.get_input_embeddings().weight.shape[0])
    return SwarmService(
        model_name=opts.name,
        model_source=cfg.model,
        limits=Limits(
            model=opts.name, vocab_size=vocab,
            max_context_tokens=cfg.generation.max_context_tokens,
            max_staleness=cfg.train.max_staleness,
        ),
        max_new_tokens=cfg.generation.max_new_tokens,
        max_message_bytes=cfg.limits.max_message_bytes,
        engine=engine, store=store, trainer=trainer, metrics=metrics,
        groups_per_step=cfg.train.groups_per_step,
        tokenizer_files=tokenizer_files(tokenizer),  # the loaded one: not read again
        chat_template=tokenizer.chat_template or "",
        eos_token_ids=eos_ids,
        max_queued_generates=cfg.limits.max_queued_generates,
    )


def _grpc_service(
    opts: ServerOptions, service: SwarmService, faults: Faults
) -> tuple[grpc.aio.Server, health.aio.HealthServicer]:
    """The gRPC server of `service`, its token check, health and reflection; not bound yet."""
    interceptors = [auth_interceptor(opts.token, service.refuse, model=opts.name,
                                     revoked=lambda node: node in service.revoked_nodes)]
    if faults.configured:  # an interceptor costs every call, even one that does nothing
        interceptors.append(drop_ack_interceptor(faults))
    rpc = grpc_server(opts.cfg.limits, interceptors)
    rpc.add_generic_rpc_handlers((service.handler(),))
    health_servicer = health.aio.HealthServicer()
    health_pb2_grpc.add_HealthServicer_to_server(health_servicer, rpc)
    reflection.enable_server_reflection(
        (SERVICE, health.SERVICE_NAME, reflection.SERVICE_NAME), rpc
    )
    return rpc, health_servicer


def _bind(rpc: grpc.aio.Server, opts: ServerOptions) -> int:
    """Bind the gRPC port (0: any free one), and the same port on the `LISTEN_ALSO_ENV`
    addresses; returns the port. A port it cannot bind exits with one line."""
    host = opts.cfg.host
    port = add_port(rpc, f"{host}:{opts.port}", opts.tls)
    if port == 0:
        raise SystemExit(f"cannot bind {host}:{opts.port}")
    for also in listen_also(host):  # the run's docker network (runtimes/docker.py)
        if not add_port(rpc, f"{also}:{port}", opts.tls):
            raise SystemExit(f"cannot bind {also}:{port} ({LISTEN_ALSO_ENV})")
    return port


def check_devices(name: str, cfg: ModelConfig) -> None:
    """A CUDA device the recipe names must exist here, and the packages its engine and
    checkpoint folder need must be installed here: one line that says so, not a traceback
    (a server on another host than the controller's is checked here, where it runs)."""
    import torch

    from jetctl.recipe import server_host_problems

    for problem in server_host_problems(cfg):
        key = ".".join(str(k) for k in problem.loc)
        raise SystemExit(f"models.{name}.{key}: {problem.value!r} {problem.message} "
                         "(checked on this host, where the server runs)")

    for key, device in (("device", cfg.device), ("generation.device", cfg.generation.device)):
        if device is None or not device.startswith("cuda"):
            continue
        count = torch.cuda.device_count() if torch.cuda.is_available() else 0
        index = int(device.split(":")[1]) if ":" in device else 0
        if index >= count:
            raise SystemExit(
                f"models.{name}.{key}: {device!r}, but torch {torch.__version__} sees "
                f"{count} CUDA device(s) here (CUDA build: {torch.version.cuda or 'no'}); "
                "use device: cpu, or run the server on a machine with that GPU"
            )


class StartingPhase:
    """What the server is doing while it starts, for the live view: each phase is logged and
    written to `server-<model>/phase.json` (`{"phase", "phase_since", "pid"}`), which the
    controller shows for a server that does not answer yet. Each phase's seconds are kept
    for `summary`, the start's account in the log."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self.began = time.time()  # the first phase: the time before it is the process's
        self.seconds: list[tuple[str, float]] = []  # (phase, seconds) of each ended phase
        self._current: tuple[str, float] | None = None  # (phase, its start)

    def __call__(self, phase: str) -> None:
        now = time.time()
        if self._current is not None:
            self.seconds.append((self._current[0], now - self._current[1]))
        self._current = (phase, now)
        log.info("%s", phase)
        write_json_atomic(self.path, {"phase": phase, "phase_since": now, "pid": os.getpid()})

    def summary(self) -> str:
        """Where the start's time went: from the process's start to the first phase (the
        interpreter, the imports, joining the controller), then each phase up to now."""
        now = time.time()
        parts: list[str] = []
        total = now - self.began
        created = process_create_time(os.getpid())
        if created:
            total = now - created
            parts.append(f"before serve() {self.began - created:.1f}s "
                         "(interpreter, imports, joining)")
        done = [*self.seconds]
        if self._current is not None and self._current[0] != "serving":
            done.append((self._current[0], now - self._current[1]))
        parts += [f"{name} {seconds:.1f}s" for name, seconds in done]
        return f"started in {total:.1f}s: " + ", ".join(parts)


def _stalled(train_since: float | None, generate_since: float | None, limit_s: float) -> str:
    """Why the server is stuck ('' when it is not): a step or a batch older than limit_s."""
    now = time.monotonic()
    for what, since in (("a training step", train_since), ("a generation batch", generate_since)):
        if since is not None and now - since > limit_s:
            return f"{what} has run for {now - since:.0f}s (> {limit_s:.0f}s)"
    return ""


def _write_endpoint(
    opts: ServerOptions, endpoint: str, metrics: str, version: int,
    refused: frozenset[str] = frozenset(),
) -> None:
    """`servers/<model>.json` in the server's own run dir: for tools on its host (benchmarks,
    chaos); the controller hears the same over `Control.Sync`."""
    write_json_atomic(RunPaths(opts.run_dir).server_file(opts.name), {
        "model": opts.name,
        "endpoint": endpoint,
        "metrics": metrics,
        "pid": os.getpid(),
        "version": version,
        "refused_revisions": sorted(refused),
    })

