"""The client node: tasks in, rollouts run, groups spooled, groups pushed.

    node = ClientNode(NodeConfig(name="digits-0", task_name="digits", task=task_cfg,
                                 run_dir=Path("runs/x"), token=token))
    exit_code = asyncio.run(node.run())

What one node does (docs/architecture.md sections 1, 2, 6):

1. Start the OpenAI-compatible proxy (timelines), /metrics, delivery, and the status sync:
   about once a second its status figures and its spool's ledger records (jetctl.journal)
   go to the controller, which answers with endpoints, refused revisions and drain orders
   (a node without a link writes `<run_dir>/nodes/<name>.json` instead).
2. Register with the task's model server (endpoint from the controller through its control
   link, jetctl.link; a node without one reads `<run_dir>/servers/<model>.json`), retried
   until it answers, and rebuild its tokenizer from the reply. A team task (`roles:`)
   registers with each of its models' servers (each endpoint from the link, by model); its
   proxy serves each role by name. The controller starts a node together with its servers,
   so this usually waits out a server's start: meanwhile the node already runs rollouts
   (3), whose env sessions open while the server loads; their model calls wait in the
   proxy until every server answered (`Proxy.serve`). The node's state is `running` from
   then on. With `inference: local` (the engine is made from the Register reply) or a
   benchmark's producer, the node registers first and starts its rollouts after.
3. Produce (production.py): run the agent on the env's tasks, `group_size` rollouts per
   task, and spool each GRPO group (durable).
4. Deliver (transport.py, `Delivery`): push the spooled groups until each has an ack; a group leaves the
   spool only on an ack. Rollouts never wait for training.
5. SIGTERM (or `drain()`): stop taking tasks, let in-flight rollouts finish or time out,
   flush the spool within `drain_grace_s`, exit 0. What is left stays in the spool file and
   is sent by the next node of the same name.

This module is the node's lifecycle and status; production and delivery share only the
spool, the counters (`NodeStats`) and the drain event. A team's node has one transport and
one delivery per model.

A rollout started before the servers answered does not count that wait against its
`rollout_timeout_s` (`Proxy.held_s`, `RolloutRunner.run(held=...)`): a server slow
to start (a large model on a slow disk) delays the node's first rollouts, it does not time
them out; an env stuck meanwhile is killed once the timeout ran after the servers answered.
A node drained (or refused) before
every server answered fails the rollouts waiting for a model, each with the reason.

Left out: SubmitStream; local inference for a team (the recipe refuses it).
"""

from __future__ import annotations

import asyncio
import logging
import os
import re
import signal
import socket
import time
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import grpc

from jetctl import tracing
from jetctl.client.concurrency import START, Governor
from jetctl.client.metrics import ClientMetrics, NodeStats
from jetctl.client.production import Producer, ProductionConfig, sleep_or
from jetctl.client.proxy import Backend, Proxy, Sampling, ServedModel
from jetctl.client.rollout import RolloutRunner, reap_leftovers
from jetctl.client.spool import Spool
from jetctl.client.timeline import ChatRenderer
from jetctl.client.transport import (
    Delivery,
    DeliveryOptions,
    EndpointNotFound,
    RetryPolicy,
    ServerBackend,
    SwarmTransport,
    short_error,
)
from jetctl.costs import NodeWaste
from jetctl.journal import SPOOL_TABLES, Journal
from jetctl.link import ControlLink, Identity
from jetctl.proto._gen import swarm_pb2 as pb
from jetctl.recipe import DEFAULT_ROLE, TaskConfig
from jetctl.rundir import RunPaths, write_json_atomic
from jetctl.tls import TlsFiles

log = logging.getLogger(__name__)

FINAL_SYNC_S = 3.0  # the drain keeps this long for the last sync with the controller

__all__ = ["ClientNode", "NodeConfig", "NodeStats"]


@dataclass
class NodeConfig:
    name: str
    task_name: str
    task: TaskConfig
    run_dir: Path  # the node's own folder: spool/<name>.sqlite (and logs)
    token: str
    index: int = 0
    deterministic_run: str | None = None  # run.deterministic: the run's name seeds the calls
    revision: str = "default"
    agent: str | None = None  # overrides task.agent
    max_groups: int | None = None  # stop after this many groups (tests, benchmarks)
    drain_grace_s: float = 30.0
    status_interval_s: float = 1.0
    metrics_port: int | None = 0  # None: no /metrics
    submit_batch_groups: int = 8
    resend_base_s: float = 0.5
    resend_max_s: float = 30.0
    probe_s: float = 2.0  # while Submit fails, resend the oldest group this often
    install_signal_handlers: bool = True
    endpoint: str | None = None  # fixed endpoint of the task's (first) model's server (chaos, tests)
    endpoints: dict[str, str] = field(default_factory=dict)  # model -> fixed endpoint (teams)
    tls: TlsFiles | None = None  # run.tls; None: plaintext
    link: ControlLink | None = None  # the controller; None: a node on its own (files)
    # benchmarks: makes the node's producer (an object with `async run()` and `backpressure`)
    # instead of the agent's rollouts; its Submit latencies go to `on_acked`
    make_producer: Callable[[ClientNode], Any] | None = None
    on_acked: Callable[[float, int], None] | None = None

    @property
    def agent_spec(self) -> str:
        return self.agent or self.task.agent


class ClientNode:
    def __init__(self, config: NodeConfig) -> None:
        self.config = config
        self.models = config.task.models  # the models its calls train (a team: several)
        self.model = self.models[0]
        self.team = bool(config.task.roles)
        self.state = "starting"
        self.stats = NodeStats()
        self.metrics = ClientMetrics()
        self.metrics_port: int | None = None
        self.paths = RunPaths(config.run_dir)
        self.spool = Spool(self.paths.spool(config.name))
        # every change the ledger reads, journaled in the spool's own transactions
        self.journal = Journal.install(self.spool.path, SPOOL_TABLES)
        self.link = config.link
        self.identity = Identity(
            name=config.name, kind="client", task=config.task_name, model=self.model,
            revision=config.revision,
        )
        link = config.link
        # live rollouts (pid, start time): a restart kills what a killed predecessor left
        self._rollout_registry = self.paths.rollouts(config.name)
        # what its trajectories that trained nothing cost, across its restarts (jetctl.costs)
        self.waste = NodeWaste(self.spool, len(config.task.role_models))
        self.transports = {
            m: SwarmTransport(
                m, config.token, run_dir=None if link else config.run_dir,
                endpoint=self._fixed_endpoint(m),
                endpoint_source=_link_endpoint(link, m) if link else None,
                tls=config.tls,
                # retries within a call stay short (<= 2 s apart): the spool retries for longer
                retry=RetryPolicy(max_s=2.0, total_s=30.0), call_timeout_s=15.0,
            )
            for m in self.models
        }
        self.deliveries = {
            m: Delivery(
                self.spool, transport, self.stats, self.metrics,
                options=DeliveryOptions(
                    batch_groups=config.submit_batch_groups, resend_base_s=config.resend_base_s,
                    resend_max_s=config.resend_max_s, probe_s=config.probe_s,
                ),
                # the server refuses this revision: nothing more to do here
                on_revision_refused=self.drain, on_acked=config.on_acked,
                model=m if self.team else None, waste=self.waste,
            )
            for m, transport in self.transports.items()
        }
        self.transport = self.transports[self.model]
        self.delivery = self.deliveries[self.model]
        self.producer: Any = None  # production.Producer (or a benchmark's)
        self.proxy: Proxy | None = None
        self.governor = (
            Governor(config.task.group_size, start=START)
            if config.task.concurrency == "auto" else None
        )
        self.backend: Backend | None = None  # the (first) model's
        self.register_replies: dict[str, pb.RegisterReply] = {}
        self.register_reply: pb.RegisterReply | None = None  # the (first) model's
        self._draining = asyncio.Event()
        self._runner: RolloutRunner | None = None
        self._local_engine: Any = None
        self._registering: asyncio.Task[None] | None = None  # beside the first rollouts

    def _fixed_endpoint(self, model: str) -> str | None:
        if model in self.config.endpoints:
            return self.config.endpoints[model]
        return self.config.endpoint if model == self.model else None

    def _wake_senders(self) -> None:
        for delivery in self.deliveries.values():
            delivery.wake()

    @property
    def backpressure(self) -> bool:
        """The spool is above spool_max_bytes: no new rollouts."""
        return self.producer is not None and self.producer.backpressure

    # ------------------------------------------------------------------ lifecycle

    def drain(self) -> None:
        """Stop taking tasks; `run` then finishes in-flight work, flushes and returns."""
        if not self._draining.is_set():
            log.info("node %s draining", self.config.name)
            self._draining.set()
            if self.state in ("starting", "running", "backoff"):
                self.state = "draining"

    async def run(self) -> int:
        """The whole life of a node; returns the process exit code."""
        loop = asyncio.get_running_loop()
        tracing.start("jetctl-client", self.config.name)  # if the environment names a collector
        if self.config.install_signal_handlers:
            for sig in (signal.SIGTERM, signal.SIGINT):
                loop.add_signal_handler(sig, self.drain)
        status_task = asyncio.create_task(self._status_loop())
        senders: list[asyncio.Task[None]] = []
        try:
            if self.config.metrics_port is not None:
                self.metrics_port = self.metrics.serve("127.0.0.1", self.config.metrics_port)
            self._recover_lost()
            # Groups left by an earlier node of this name go out first.
            senders = [asyncio.create_task(d.run()) for d in self.deliveries.values()]
            if not await self._start_serving():
                return await self._finish(senders, status_task)
            await self._produce()
            return await self._finish(senders, status_task)
        except BaseException:
            self.state = "exited"
            for sender in senders:
                sender.cancel()
            status_task.cancel()
            self._write_status()
            raise
        finally:
            await self._shutdown()

    def _recover_lost(self) -> None:
        """Rollouts an earlier process of this node left running (it was killed) are lost."""
        self.spool.label_unlabelled(self.model)  # rows of a spool written before teams
        reaped = reap_leftovers(self._rollout_registry)
        if reaped:
            log.warning("killed %d rollout(s) an earlier process of %s left running",
                        reaped, self.config.name)
        # trained nothing, costs unknown: to the waste tally in the same transaction
        def unknown(n: int) -> dict[str, float]:
            return self.waste.tally(({}, None) for _ in range(n))[0]

        lost = self.spool.recover_lost(
            "the node died while this rollout ran (killed or crashed)", waste=unknown)
        if lost:
            log.warning("%d rollouts of an earlier process of %s were lost", lost, self.config.name)
            self.stats.drop("lost", lost)
            self.metrics.dropped.labels(reason="lost").inc(lost)
            self.waste.recorded(unknown(lost))

    async def _finish(
        self, senders: list[asyncio.Task[None]], status_task: asyncio.Task[None]
    ) -> int:
        self.state = "draining"
        deliveries = list(self.deliveries.values())
        # keep a little of the grace for the last sync, which carries the last ledger records
        grace = max(0.0, self.config.drain_grace_s - FINAL_SYNC_S)
        await asyncio.gather(*(d.flush(grace) for d in deliveries))
        for delivery, sender in zip(deliveries, senders):
            delivery.stop()
            sender.cancel()  # a Submit still retrying is abandoned; its groups stay spooled
            try:
                await sender
            except asyncio.CancelledError:
                pass
        self.state = "exited"
        status_task.cancel()
        await self._report(final=True)
        return 0

    async def _shutdown(self) -> None:
        if self.proxy is not None:
            await self.proxy.stop()
        if self._runner is not None:
            self._runner.shutdown()
        for transport in self.transports.values():
            await transport.close()
        if self.link is not None:
            await self.link.close()
        self.metrics.close()
        self.spool.close()

    async def _register(self) -> bool:
        """Register with each model's server, retrying with backoff until it answers (False
        if drained first, or a server refuses this node's revision). A drain ends the wait
        at once: a Register waiting for a server that still loads is cancelled."""
        registering = asyncio.ensure_future(self._register_each())
        drained = asyncio.ensure_future(self._draining.wait())
        try:
            await asyncio.wait({registering, drained}, return_when=asyncio.FIRST_COMPLETED)
        finally:
            for task in (registering, drained):
                task.cancel()
            await asyncio.gather(registering, drained, return_exceptions=True)
        if registering.cancelled():
            return False
        return registering.result()  # raises what registering raised

    async def _register_each(self) -> bool:
        for model, transport in self.transports.items():
            reply = await self._register_with(model, transport)
            if reply is None:
                return False
            self.register_replies[model] = reply
        self.register_reply = self.register_replies[self.model]
        return True

    async def _register_with(
        self, model: str, transport: SwarmTransport
    ) -> pb.RegisterReply | None:
        delay = 0.5
        while not self._draining.is_set():
            try:
                reply = await transport.register(
                    self.config.name, self.config.task_name, self.config.revision
                )
            except (grpc.aio.AioRpcError, EndpointNotFound) as e:
                self.state = "backoff"
                # the controller starts a node with its servers: a server that never
                # answered yet is most likely still loading its model
                level = logging.WARNING if transport.answered else logging.INFO
                log.log(level, "register with %s failed (%s); retrying in %.1fs", model,
                        short_error(e), delay)
                await sleep_or(self._draining, delay)
                delay = min(delay * 2, 10.0)
                continue
            if self._refused(reply.refused_revisions):
                log.warning("server %s refuses revision %s; exiting", model, self.config.revision)
                self.drain()
                return None
            return reply
        return None

    async def _start_serving(self) -> bool:
        """The proxy, the rollout runner and the producer, and the registration with each
        model's server: beside the first rollouts (`_register_and_serve`), or before them for
        `inference: local` and a benchmark's producer. False: drained (or refused) before the
        node registered, when it registers first."""
        cfg = self.config
        if cfg.make_producer is not None:
            if not await self._register():
                return False
            self.producer = cfg.make_producer(self)
            self._set_running()
            return True
        sampling = cfg.task.sampling
        self.proxy = Proxy(  # waits for serve (Register's replies) or refuse
            None, None, Sampling(sampling.temperature, sampling.top_p, sampling.max_tokens)
        )
        await self.proxy.start()
        if cfg.task.inference == "local":  # its engine is made from the Register reply
            if not await self._register():
                return False
            await self._serve_models()
            self._start_producer()
            self._set_running()
            return True
        self._start_producer()
        self._registering = asyncio.create_task(self._register_and_serve())
        return True

    async def _register_and_serve(self) -> None:
        """Register with each model's server, then let the proxy answer the model calls
        that waited meanwhile; a node drained (or refused) first fails them instead."""
        assert self.proxy is not None
        if not await self._register():
            self.proxy.refuse(
                f"node {self.config.name} stopped before the server of each of its models "
                f"({', '.join(self.models)}) answered Register"
            )
            return
        await self._serve_models()
        self._set_running()

    def _set_running(self) -> None:
        self.state = "running" if not self._draining.is_set() else "draining"

    async def _serve_models(self) -> None:
        """Tokenizers from the Register replies and each model's backend (its server, or the
        local engine): the proxy serves each model (or role) from now on."""
        cfg = self.config
        assert self.proxy is not None
        backends: dict[str, Backend] = {}
        renderers: dict[str, ChatRenderer] = {}
        for model, reply in self.register_replies.items():
            renderers[model] = await _renderer(reply)
            if cfg.task.inference == "local":  # one model: the recipe refuses it for teams
                from jetctl.client.local_engine import LocalEngine

                engine = await LocalEngine.start(
                    reply.model_source, self.transports[model], reply.model_version
                )
                self._local_engine = engine
                backends[model] = engine
            else:
                backends[model] = ServerBackend(self.transports[model], self.governor)
        self.backend = backends[self.model]

        def served(name: str, model: str, role: str) -> ServedModel:
            context = int(self.register_replies[model].max_context_tokens) or 2048
            return ServedModel(name, renderers[model], backends[model], context, model, role)

        if self.team:  # the agent names a role; each role's calls go to its model
            names = {r: served(r, m, r) for r, m in cfg.task.role_models.items()}
        else:
            names = {self.model: served(self.model, self.model, DEFAULT_ROLE)}
        self.proxy.serve(names, default_model=None if self.team else self.model)

    def _start_producer(self) -> None:
        """The rollout runner (its forkserver preloads the env's and agent's modules, and
        those `env_args` name as `module:attr`, a dataset task's reward for one) and the
        producer, which starts rollouts at once."""
        cfg = self.config
        assert self.proxy is not None
        env_module = cfg.task.env.partition(":")[0]
        agent_module = cfg.agent_spec.partition(":")[0]
        governor = self.governor
        self._runner = RolloutRunner(
            [env_module, agent_module],
            max_workers=governor.ceiling if governor is not None else int(cfg.task.concurrency),
            registry=self._rollout_registry,
            soft_preload=named_modules(cfg.task.env_args),
        )
        self.producer = Producer(
            ProductionConfig(
                node=cfg.name, task_name=cfg.task_name, task=cfg.task,
                agent=cfg.agent_spec, revision=cfg.revision, index=cfg.index,
                max_groups=cfg.max_groups, deterministic_run=cfg.deterministic_run,
            ),
            self.proxy, self._runner, self.spool, self.stats, self.metrics,
            draining=self._draining, on_spooled=self._wake_senders,
            local_engine=self._local_engine, governor=governor, link=self.link,
            waste=self.waste,
        )
        self.metrics.concurrency.set(self.producer.slots.limit)

    async def _produce(self) -> None:
        """Run the producer until it stops (drained, or `max_groups`). A registration
        beside it that raises ends the node with that error, as a failed start always did;
        one still under way when the producer stops is cancelled."""
        assert self.producer is not None
        registering = self._registering
        if registering is None:
            await self.producer.run()
            return
        producing = asyncio.ensure_future(self.producer.run())
        try:
            await asyncio.wait({producing, registering}, return_when=asyncio.FIRST_COMPLETED)
            if registering.done():
                registering.result()  # raises what the registration raised
            await producing
        finally:
            left = [t for t in (producing, registering) if not t.done()]
            for task in left:
                task.cancel()
            await asyncio.gather(*left, return_exceptions=True)

    def _refused(self, refused: Iterable[str]) -> bool:
        """A plain revision, or `<task>/<revision>` (swap-clients --drop-old)."""
        mine = {self.config.revision, f"{self.config.task_name}/{self.config.revision}"}
        return bool(mine & set(refused))

    # ------------------------------------------------------------------ status

    async def _status_loop(self) -> None:
        while True:
            await self._report()
            await asyncio.sleep(self.config.status_interval_s)

    async def _report(self, final: bool = False) -> None:
        """Status (and ledger records) to the controller, or to the status file without one;
        follow what the controller answers."""
        if self.link is None:
            self._write_status()
            return
        sync = self.link.sync(self.identity, status=self.status(), journal=self.journal,
                              final=final)
        try:
            reply = await (asyncio.wait_for(sync, FINAL_SYNC_S) if final else sync)
        except asyncio.TimeoutError:
            reply = None
        if reply is None:
            if final:
                log.warning("last sync with the controller failed: it gets this node's last "
                            "ledger records from the next node of this name")
            return
        if reply.drain and not self._draining.is_set():
            log.info("%s", reply.message or "the controller asked this node to drain")
            self.drain()
        if self._refused(reply.refused_revisions) and not self._draining.is_set():
            log.warning("server %s refuses revision %s; draining", self.model,
                        self.config.revision)
            self.drain()

    def status(self) -> dict[str, Any]:
        reachable = all(d.reachable for d in self.deliveries.values())
        self.metrics.server_reachable.set(1 if reachable else 0)
        depth = self.spool.depth()
        self.metrics.spool_groups.set(depth)
        self.metrics.spool_oldest_age.set(self.spool.oldest_age_s())
        return {
            "name": self.config.name,
            "task": self.config.task_name,
            "model": self.model,
            "models": list(self.models),
            "roles": dict(self.config.task.roles),
            "state": self.state,
            "revision": self.config.revision,
            "rollouts_done": self.stats.rollouts_done,
            "rollouts_failed": self.stats.rollouts_failed,
            "rollouts_timeout": self.stats.rollouts_timeout,
            "groups_spooled": self.stats.groups_spooled,
            "spool_depth": depth,
            "spool_bytes": self.spool.bytes(),
            "backpressure": self.backpressure,
            **self._concurrency(),
            "server_reachable": reachable,
            "acks": dict(self.stats.acks),
            "dropped": dict(self.stats.dropped),
            # tokens generated for this node's calls, by model (a team's calls reach several)
            "tokens_generated": dict(self.proxy.tokens_generated) if self.proxy else {},
            # what its trajectories that trained nothing cost (jetctl/costs.py)
            "waste": dict(self.waste.totals),
            "pid": os.getpid(),
            "host": socket.gethostname(),
            "address": self.link.address if self.link is not None else None,
            "updated_at": time.time(),
            "metrics": f"127.0.0.1:{self.metrics_port}" if self.metrics_port else None,
            "proxy": f"127.0.0.1:{self.proxy.port}"
            if self.proxy is not None and self.proxy.port
            else None,
        }

    def _concurrency(self) -> dict[str, Any]:
        """The rollout limit in force and why (`auto`), for `jetctl status`."""
        producer = self.producer
        if not isinstance(producer, Producer):  # not serving yet, or a test's producer
            return {}
        governor = producer.governor
        return {
            "concurrency": producer.slots.limit,
            "concurrency_why": governor.why if governor is not None else "fixed by the recipe",
        }

    def _write_status(self) -> None:
        write_json_atomic(self.paths.node_file(self.config.name), self.status())


def named_modules(env_args: Mapping[str, Any]) -> list[str]:
    """The modules of the `module:attr` strings among `env_args`' values (a dataset task's
    `reward`): each rollout would import them afresh; the forkserver tries them once (one
    that fails there is imported, and fails, in the rollout, as before)."""
    return sorted({v.partition(":")[0] for v in env_args.values()
                   if isinstance(v, str) and _OBJECT_SPEC.fullmatch(v)})


_OBJECT_SPEC = re.compile(r"[A-Za-z_][\w.]*:[A-Za-z_][\w.]*")


def _link_endpoint(link: ControlLink, model: str) -> Callable[[], str]:
    """Where `model`'s server is, as the controller said last (one source per model)."""
    return lambda: link.endpoint(model)


async def _renderer(reply: pb.RegisterReply) -> ChatRenderer:
    """The chat renderer of a server's model, from its tokenizer files in `reply`."""
    from jetctl.models import tokenizer_from_files

    loop = asyncio.get_running_loop()
    tokenizer = await loop.run_in_executor(None, tokenizer_from_files, dict(reply.tokenizer_files))
    if reply.chat_template:
        tokenizer.chat_template = reply.chat_template
    return ChatRenderer(tokenizer, list(reply.eos_token_ids))
