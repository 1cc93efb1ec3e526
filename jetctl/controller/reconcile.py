"""Reconcile: start the desired nodes through their runtimes and keep them running.

`Reconciler.tick()` runs about once a second in the controller's main loop: a node that died
is restarted after its backoff (doubling up to `run.restart_backoff_max_s`, reset once it
stayed up `stable_s`); a server is `running` once it answers gRPC health and synced with the
controller since its start. A task's clients start in the same pass as the servers, not after
them: a node joins the controller, opens its env sessions and starts rollouts while its
model's server loads (10-20 s of a CPU server's start), and its rollouts' model calls wait
until the server answers Register (jetctl/client/node.py), so the two starts overlap. The
process and docker runtimes need nothing of a server before a client starts: its endpoint
(and a client container's gateway port) is fixed before either starts, and a server elsewhere
(ray, external) is looked up through the controller until it syncs. A task on `runtime: ray`
keeps the old order (its clients start once their models' servers were ready once): its
nodes' placement groups must not take the cluster resources a server still waits for. Nodes
the controller does not start (a client that joined by hand, a server with runtime:
external) are followed through their syncs only.

Every node it starts gets the controller's address, a token and the TLS mode in its
environment (`JETCTL_CONTROL`, `JETCTL_TOKEN`, `JETCTL_TLS_MODE`, `JETCTL_TLS_DIR`) and
joins like a node on another host would: nothing else of the run dir is read by a node. A
server gets the run token; a client node its own credential (jetctl.auth: client calls of
its task's models only). A client container on the run's network dials the controller and
its servers at the network's gateway (`JETCTL_ENDPOINT_OVERRIDE`), where they also listen.
`probe_loop` (its own thread) asks each server for health and `Status`. `drain_nodes` is the
SIGTERM-wait-SIGKILL that `down`, the end of a run and a swap share. Both call the runtimes
outside the run state's lock (decide under it, act outside it, record under it), so that a
slow docker start or kill does not hold up the run's Status and Sync calls.

Servers run on the process runtime; each task's clients run on its `runtime:` (process, or
docker: one container per node, see runtimes/docker.py).
"""

from __future__ import annotations

import json
import logging
import sys
import threading
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Protocol

from jetctl import auth, tracing
from jetctl.controller.probe import ServerProbe
from jetctl.controller.runtimes.base import (
    ContainerSpec,
    Mount,
    NodeHandle,
    NodeKind,
    NodeSpec,
    NodeState,
    Placement,
    Runtime,
)
from jetctl.controller.state import (
    FIRST_REVISION,
    Node,
    NodeRunState,
    RunState,
    TaskRevision,
    client_node_name,
    server_node_name,
)
from jetctl.faults import ENDPOINT_OVERRIDE_ENV
from jetctl.link import CONTROL_ENV
from jetctl.net import LISTEN_ALSO_ENV, connect_host, free_port
from jetctl.recipe import byte_size
from jetctl.rundir import TOKEN_ENV, RunDirError, RunPaths
from jetctl.tls import TLS_DIR_ENV, TLS_MODE_ENV

log = logging.getLogger("jetctl.controller")

# the commands inside a client image (images/base/Dockerfile puts jetctl on PATH)
CONTAINER_PREFIX = ("jetctl",)
# the commands a Ray actor runs: its own interpreter (runtimes/ray.py swaps it in)
RAY_PREFIX = ("python", "-m", "jetctl.cli.main")
DEFAULT_IMAGE = "jetctl-base"
# where a client container on the run's network finds its TLS files (mounted read-only)
CONTAINER_TLS_DIR = Path("/run/jetctl/tls")


def _port(address: str) -> int:
    return int(address.rsplit(":", 1)[1])


@dataclass(frozen=True)
class ControllerOptions:
    tick_s: float = 1.0  # reconcile period
    grace_s: float = 30.0  # default drain time per phase (clients, then servers)
    stable_s: float = 60.0  # a node up this long gets its restart backoff reset
    plot_every_s: float = 30.0  # reward curve refresh period during the run
    probe_s: float = 1.0  # server Status poll period
    probe_timeout_s: float = 1.0


# a node whose drain began while it started did no work yet: it gets this long to stop
ORPHAN_GRACE_S = 5.0


@dataclass(frozen=True)
class _Start:
    """A start decided under the lock: the node, the state it was decided in (it is
    recorded only if the node is still in that state) and what to run."""

    node: Node
    was: NodeRunState
    restart: bool
    spec: NodeSpec


class CommandBuilder(Protocol):
    """Builds the argv of each node; tests swap in fake nodes here."""

    def server(self, model: str, port: int, metrics_port: int | None) -> list[str]: ...

    def client(
        self, task: str, index: int, revision: str, name: str | None = None,
        agent: str | None = None,
    ) -> list[str]: ...


@dataclass(frozen=True)
class JetctlCommands:
    """`jetctl server` / `jetctl client` (docs/CONTRACTS.md), run by this Python without PATH.
    They join the controller named in their environment; `--run-dir` is their own folder
    (here the run dir, on this host)."""

    recipe: Path
    run_dir: Path
    prefix: tuple[str, ...] = (sys.executable, "-m", "jetctl.cli.main")

    def server(self, model: str, port: int, metrics_port: int | None) -> list[str]:
        argv = [*self.prefix, "server", "--model", model]
        argv += ["--run-dir", str(self.run_dir), "--port", str(port)]
        if metrics_port:
            argv += ["--metrics-port", str(metrics_port)]
        return argv

    def client(
        self, task: str, index: int, revision: str, name: str | None = None,
        agent: str | None = None,
    ) -> list[str]:
        argv = [*self.prefix, "client", "--task", task]
        argv += ["--index", str(index), "--run-dir", str(self.run_dir), "--revision", revision]
        if name is not None:
            argv += ["--name", name]
        if agent is not None:
            argv += ["--agent", agent]
        return argv


class Reconciler:
    """Starts, restarts, adopts and drains the nodes of `state` through the runtimes."""

    def __init__(
        self,
        state: RunState,
        *,
        runtime: Runtime,
        runtimes: Mapping[str, Runtime],
        commands: CommandBuilder,
        container_commands: CommandBuilder,
        options: ControllerOptions,
        kill_now: threading.Event,
    ) -> None:
        self.state = state
        self.recipe = state.recipe
        self.paths: RunPaths = state.paths
        self.runtime = runtime
        # servers and process tasks run on `runtime`; docker tasks on runtimes["docker"],
        # made in open_runtimes() when a task asks for it and none was given
        self.runtimes: dict[str, Runtime] = {"process": runtime, **runtimes}
        self.commands = commands
        self.container_commands = container_commands
        self.opts = options
        self.token = ""  # set by the controller's setup, before anything starts
        self.control = ""  # host:port of the Control service, for the nodes it starts
        self._kill_now = kill_now
        self._probes: dict[str, ServerProbe] = {}

    # -- runtimes -------------------------------------------------------------------------

    def open_runtimes(self) -> None:
        """Make the docker and ray runtimes when the recipe needs them (docker: check the
        images are built; ray: connect to the cluster)."""
        if self.recipe.uses_ray and "ray" not in self.runtimes:
            from jetctl.controller.runtimes.base import RuntimeUnavailable
            from jetctl.controller.runtimes.ray import RayRuntime

            try:
                self.runtimes["ray"] = RayRuntime(self.recipe.run.name, self.recipe.run.ray)
            except RuntimeUnavailable as e:
                raise RunDirError(f"the recipe uses runtime: ray, but {e}") from None
        docker_tasks = [t for t, c in self.recipe.tasks.items() if c.runtime == "docker"]
        if not docker_tasks:
            return
        from jetctl.controller.runtimes.docker import DockerRuntime, RuntimeUnavailable

        try:
            if "docker" not in self.runtimes:
                self.runtimes["docker"] = DockerRuntime(self.paths.root)
            rt = self.runtimes["docker"]
            check = getattr(rt, "check_image", None)
            if check is not None:
                images = {self.image(t, self.state.revisions[t]) for t in docker_tasks}
                for image in sorted(images):
                    check(image)
        except RuntimeUnavailable as e:
            tasks = ", ".join(docker_tasks)
            raise RunDirError(f"tasks {tasks} use runtime: docker, but {e}") from None

    def image(self, task: str, rev: TaskRevision) -> str:
        return rev.image or self.recipe.tasks[task].image or DEFAULT_IMAGE

    def rt(self, handle: NodeHandle) -> Runtime:
        """The runtime that runs `handle` (containers: docker; actors: ray; the rest: the
        process one)."""
        if handle.runtime and handle.runtime in self.runtimes:
            return self.runtimes[handle.runtime]
        if handle.container_id and "docker" in self.runtimes:
            return self.runtimes["docker"]
        return self.runtime

    def list_running(self) -> list[NodeHandle]:
        """Nodes an earlier controller of this run left running (exited containers pruned)."""
        found: list[NodeHandle] = []
        for rt in self.runtimes.values():
            rt.prune(self.recipe.run.name)
            found += rt.list(self.recipe.run.name)
        return found

    def prune(self) -> None:
        for rt in self.runtimes.values():
            rt.prune(self.recipe.run.name)

    # -- desired state --------------------------------------------------------------------

    def build_nodes(self, prior_ports: dict[str, int]) -> None:
        """One server per model (on its recipe port, else the one it had, else a free one)
        and `clients` nodes per task at the task's current revision."""
        run = self.recipe.run
        nodes = self.state.nodes
        for model, mcfg in self.recipe.models.items():
            local = mcfg.runtime == "process"
            port = mcfg.port or prior_ports.get(model) or (free_port(mcfg.host) if local else 0)
            node = Node(
                name=server_node_name(model),
                kind="server",
                model=model,
                port=port,
                # elsewhere (ray, external) the server says where it is when it syncs
                endpoint=f"{connect_host(mcfg.host)}:{port}" if local else "",
                backoff_s=run.restart_backoff_s,
                labels={"jetctl.run": run.name, "jetctl.kind": "server", "jetctl.model": model},
                runtime=mcfg.runtime,
            )
            nodes[node.name] = node
        for task, tcfg in self.recipe.tasks.items():
            for i in range(tcfg.clients):
                node = self.client_node(task, i, self.state.revisions[task])
                nodes[node.name] = node

    def client_node(self, task: str, index: int, rev: TaskRevision) -> Node:
        tcfg = self.recipe.tasks[task]
        node = Node(
            name=client_node_name(task, index, rev.revision),
            kind="client",
            model=tcfg.models[0],  # a team's node also reaches the task's other models
            task=task,
            index=index,
            revision=rev.revision,
            backoff_s=self.recipe.run.restart_backoff_s,
            runtime=tcfg.runtime,
            agent=rev.agent,
            image=self.image(task, rev) if tcfg.runtime == "docker" else None,
        )
        node.labels = {
            "jetctl.run": self.recipe.run.name,
            "jetctl.kind": "client",
            "jetctl.task": node.task,
            "jetctl.revision": node.revision,
        }
        return node

    def adopt(self, handles: Sequence[NodeHandle]) -> None:
        """Take over running nodes the recipe still asks for; stop the others."""
        extras: list[NodeHandle] = []
        now = time.monotonic()
        for h in handles:
            node = self.state.nodes.get(h.spec.name)
            if node is None or node.kind != h.spec.kind:
                extras.append(h)
                continue
            node.handle, node.last_pid, node.up_since = h, h.pid or 0, now
            node.revision = h.spec.revision
            node.state = "starting" if node.kind == "server" else "running"
            log.info("adopted %s (pid %s)", node.name, h.pid)
        if extras:
            log.info("stopping nodes the recipe no longer asks for: %s", [h.spec.name for h in extras])
            for rt in self.runtimes.values():
                mine = [h for h in extras if self.rt(h) is rt]
                rt.stop_all(mine, self.opts.grace_s)
                for h in mine:
                    rt.release(h)

    def spec(self, node: Node) -> NodeSpec:
        commands = self.commands
        if node.runtime == "docker":
            commands = self.container_commands
        elif node.runtime == "ray":
            commands = JetctlCommands(
                self.state.recipe_path, Path(self._ray_work_dir()), prefix=RAY_PREFIX
            )
        if node.kind == "server":
            mcfg = self.recipe.models[node.model]
            argv = commands.server(node.model, node.port, mcfg.metrics_port or None)
        else:
            name = None if node.revision == FIRST_REVISION else node.name
            argv = commands.client(node.task, node.index, node.revision, name, node.agent)
        return NodeSpec(
            name=node.name,
            kind=node.kind,
            argv=argv,
            log_path=self.paths.log(node.name),
            model=node.model,
            task=node.task,
            index=node.index,
            revision=node.revision,
            env=self.env(node),
            labels=dict(node.labels),
            container=self.container_spec(node) if node.runtime == "docker" else None,
            placement=self.placement(node) if node.runtime == "ray" else None,
        )

    def env(self, node: Node) -> dict[str, str]:
        """`node_env` with the node's own credential (a client), and for a client container on
        the run's network the addresses it dials there and its TLS files' mount."""
        env = self.node_env(remote=node.runtime == "ray", kind=node.kind)
        if node.kind == "client":
            env[TOKEN_ENV] = auth.node_credential(self.token, node.name, self._models(node))
        if node.runtime == "docker" and self._isolated(node):
            gateway = self.container_gateway()
            assert gateway is not None, "an isolated docker task without the docker runtime"
            env[CONTROL_ENV] = f"{gateway}:{_port(self.control)}"
            env[ENDPOINT_OVERRIDE_ENV] = ",".join(
                f"{m}={gateway}:{port}" for m, port in self._server_ports(node).items()
            )
            if self.state.tls is not None:
                env[TLS_DIR_ENV] = str(CONTAINER_TLS_DIR)
        return env

    def node_env(self, remote: bool = False, kind: NodeKind = "client") -> dict[str, str]:
        """What a node needs to join: the controller's address (as this host dials it, or
        as others do), the run token, the TLS files (on another host: the text of those its
        side reads; a server dials the controller too), and for a server on this host the
        run's docker network gateway to listen on too."""
        env = {CONTROL_ENV: self.state.endpoint if remote else self.control, TOKEN_ENV: self.token}
        env.update(tracing.environment(self.recipe.run.tracing.otlp_endpoint
                                       if self.recipe.run.tracing else None))
        gateway = self.container_gateway()
        if kind == "server" and not remote and gateway is not None:
            env[LISTEN_ALSO_ENV] = gateway
        tls = self.state.tls
        if tls is not None:
            env[TLS_MODE_ENV] = tls.mode
            if remote:
                from jetctl.controller.runtimes.ray import TLS_PEMS_ENV

                files = tls.needed("client") + (tls.needed("server") if kind == "server" else [])
                pems = {p.name: p.read_text() for p in files}
                env[TLS_PEMS_ENV] = json.dumps(pems)
            else:
                env[TLS_DIR_ENV] = str(tls.dir)
        return env

    def container_gateway(self) -> str | None:
        """This host's address on the run's docker network, when a task runs isolated there."""
        if not any(
            c.runtime == "docker" and c.network == "isolated" for c in self.recipe.tasks.values()
        ):
            return None
        network = getattr(self.runtimes.get("docker"), "network", None)
        return str(network().gateway) if network is not None else None

    def _isolated(self, node: Node) -> bool:
        return self.recipe.tasks[node.task].network == "isolated"

    def _models(self, node: Node) -> list[str]:
        task = self.recipe.tasks.get(node.task)
        return list(task.models) if task is not None else [node.model]

    def _server_ports(self, node: Node) -> dict[str, int]:
        """model -> port of its server on this host, for each model the node's task trains
        (a server on another host is not reached from the run's network: logged)."""
        ports: dict[str, int] = {}
        for model in self._models(node):
            server = self.state.nodes.get(server_node_name(model))
            if server is None or not server.managed or not server.port:
                log.warning("%s: the server of %s is not on this host, so the run's docker "
                            "network does not reach it: use network: host", node.name, model)
                continue
            ports[model] = server.port
        return ports

    def _ray_work_dir(self) -> str:
        work_dir = getattr(self.runtimes.get("ray"), "work_dir", None)
        assert work_dir is not None, "runtime: ray without the ray runtime"
        return str(work_dir())

    def placement(self, node: Node) -> Placement:
        """The node's bundle: one placement group per task revision (a bundle per client
        node), one per server."""
        if node.kind == "server":
            res = self.recipe.models[node.model].resources
            cpus, gpus, memory, custom = res.cpus, res.gpus, res.memory, res.custom
            group, bundles = f"server/{node.model}", 1
        else:
            tres = self.recipe.tasks[node.task].resources
            cpus, gpus, memory, custom = tres.cpus, tres.gpus, tres.memory, tres.custom
            group, bundles = f"{node.task}/{node.revision}", self.recipe.tasks[node.task].clients
        resources = {"CPU": cpus if cpus is not None else 1.0, **custom}
        if gpus:
            resources["GPU"] = gpus
        if memory:
            resources["memory"] = float(byte_size(memory))
        return Placement(
            group=group, bundles=max(bundles, node.index + 1), index=node.index,
            resources=tuple(sorted(resources.items())), work_dir=self._ray_work_dir(),
        )

    def container_spec(self, node: Node) -> ContainerSpec:
        """The node's image and limits; what it mounts besides its own spool and log: the
        TLS files a client presents, read-only (never a key of the server or the CA); the
        ports of this host it dials (opened to the run's network, nothing else)."""
        task = self.recipe.tasks[node.task]
        res = task.resources
        mounts: list[Mount] = []
        tls = self.state.tls
        if tls is not None:
            for path in tls.needed("client"):
                target = CONTAINER_TLS_DIR / path.name if self._isolated(node) else path
                mounts.append(Mount(path.resolve(), read_only=True, target=target,
                                    private=path.suffix == ".key"))
        reach: tuple[int, ...] = ()
        if task.network == "isolated":
            reach = (_port(self.control), *self._server_ports(node).values())
        return ContainerSpec(
            image=node.image or DEFAULT_IMAGE,
            cpus=res.cpus,
            memory=res.memory,
            pids=res.pids,
            shm=res.shm,
            mounts=tuple(mounts),
            spool=self.paths.container_spool(node.name),
            docker_socket=task.docker_socket,
            network=task.network,
            reach=reach,
        )

    # -- the loop -------------------------------------------------------------------------
    #
    # The runtimes are called outside the run state's lock: a docker start or kill takes
    # seconds, and every Status and Sync of the run waits on that lock. What to do is decided
    # under it, done outside it, and recorded under it again only for a node no other thread
    # changed meanwhile (a drain that began during a start wins: the new node is stopped).

    def tick(self) -> None:
        """One pass: notice exits and readiness, start what is due."""
        self.container_gateway()  # a node's spec reads it; made (docker) on first use, here
        with self.state.lock:
            watched = [
                (n, h) for n in self.state.nodes.values()
                if n.managed and (h := n.handle) is not None and n.state in ("starting", "running")
            ]
        seen = [(n, h, self.rt(h).poll(h)) for n, h in watched]
        now = time.monotonic()
        with self.state.lock:
            exited = self._record_polls(seen, now)
            starts = self._due_starts(now, skip={n.name for n, _ in exited})
        for _, h in exited:
            self.rt(h).release(h)
        for start in starts:
            self._start(start)

    def _record_polls(
        self, seen: Sequence[tuple[Node, NodeHandle, NodeState]], now: float
    ) -> list[tuple[Node, NodeHandle]]:
        """Exits and readiness of the polled nodes still on the handle and state they were
        polled in (a drain takes a node over); returns the exited ones, to release."""
        exited: list[tuple[Node, NodeHandle]] = []
        for node, handle, st in seen:
            if node.handle is not handle or node.state not in ("starting", "running"):
                continue
            if not st.running:
                self._on_exit(node, st.exit_code, now)
                exited.append((node, handle))
            elif node.state == "starting" and self._ready(node):
                node.state = "running"
                if node.kind == "server":
                    self.state.ever_ready.add(node.model)
                log.info("%s is up (pid %s)", node.name, node.last_pid)
        return exited

    def _due_starts(self, now: float, skip: set[str]) -> list[_Start]:
        """Follow the nodes the controller does not start; the starts that are due (a node
        that exited in this pass waits for the next), each counted and specified."""
        starts: list[_Start] = []
        for node in self.state.nodes.values():
            if not node.managed:
                self._follow(node)
            elif node.name in skip or node.handle is not None:
                continue
            elif node.state == "restarting" and now >= node.next_start_at:
                starts.append(self._begin_start(node, restart=True))
            elif node.state == "pending" and (
                node.kind == "server" or node.runtime != "ray" or self._servers_were_ready(node)
            ):
                # a client waits for its servers itself (its Register and its rollouts' model
                # calls wait), so it starts with them and its start overlaps theirs
                starts.append(self._begin_start(node, restart=False))
        return starts

    def _servers_were_ready(self, node: Node) -> bool:
        """A ray task's client starts once each model its task trains (a team: several) was
        ready once: on a cluster its nodes' placement groups could otherwise take the
        resources a server's placement group still waits for, and the clients would wait for
        a server that cannot be placed."""
        models = self.recipe.tasks[node.task].models if node.task in self.recipe.tasks else []
        return all(m in self.state.ever_ready for m in models or [node.model])

    def _ready(self, node: Node) -> bool:
        if node.kind == "client":
            return True
        report = self.state.reports.get(node.name)
        synced = report is not None and report.received_at >= node.started_at
        return self.state.healthy.get(node.model, False) and synced

    def _follow(self, node: Node) -> None:
        """A server the user runs (runtime: external): ready like the others, once it joined
        (a joined client runs from its join on; status shows when its syncs stop)."""
        if node.kind == "server" and node.state == "starting" and self._ready(node):
            node.state = "running"
            self.state.ever_ready.add(node.model)
            log.info("%s is up (on %s)", node.name, node.host or "?")

    def _begin_start(self, node: Node, restart: bool) -> _Start:
        """Under the lock: count the start and take the node's spec."""
        if restart:
            node.restarts += 1
        if node.kind == "server":
            self.state.healthy[node.model] = False
        node.started_at = time.time()
        return _Start(node, node.state, restart, self.spec(node))

    def _start(self, start: _Start) -> None:
        """Start the node outside the lock; record it under the lock if it is still in the
        state the start was decided in, else stop what started (a drain or a swap's
        rollback took the node meanwhile)."""
        node, rt = start.node, self.runtimes[start.node.runtime]
        try:
            handle = rt.start(start.spec)
        except OSError as e:
            log.error("could not start %s: %s", node.name, e)
            with self.state.lock:
                if self._still(start):
                    self._schedule_restart(node, time.monotonic())
            return
        with self.state.lock:
            kept = self._still(start)
            if kept:
                node.handle, node.last_pid = handle, handle.pid or 0
                node.state, node.up_since, node.exit_code = "starting", time.monotonic(), None
        if not kept:
            log.info("%s was drained while it started: stopping it", node.name)
            rt.stop(handle, ORPHAN_GRACE_S)
            rt.release(handle)
            return
        verb = f"restarted (restart {node.restarts})" if start.restart else "started"
        log.info("%s %s, pid %s", node.name, verb, handle.pid)

    def _still(self, start: _Start) -> bool:
        """The node is in the run, without a handle, in the state its start was decided in."""
        node = start.node
        return (self.state.nodes.get(node.name) is node and node.handle is None
                and node.state == start.was)

    def _on_exit(self, node: Node, code: int | None, now: float) -> None:
        """Record an exit (the caller releases the handle, outside the lock)."""
        node.handle, node.exit_code = None, code
        if node.kind == "server":
            self.state.healthy[node.model] = False
            if code == 0 and self.state.reached_max_steps(node.model):
                node.state = "exited"
                log.info("%s finished training and exited", node.name)
                return
        if now - node.up_since >= self.opts.stable_s:
            node.backoff_s = self.recipe.run.restart_backoff_s
        self._schedule_restart(node, now)
        log.warning(
            "%s exited (code %s) after %.1fs; restarting in %.1fs",
            node.name, code, now - node.up_since, node.next_start_at - now,
        )

    def _schedule_restart(self, node: Node, now: float) -> None:
        node.next_start_at = now + node.backoff_s
        node.backoff_s = min(node.backoff_s * 2, self.recipe.run.restart_backoff_max_s)
        node.state = "restarting"

    # -- drain ----------------------------------------------------------------------------

    def drain(self, kind: NodeKind, grace_s: float) -> None:
        """SIGTERM every node of `kind`, wait up to `grace_s` (or a kill request), SIGKILL the rest."""
        with self.state.lock:
            nodes = [n for n in self.state.nodes.values() if n.kind == kind]
        self.drain_nodes(nodes, grace_s, kind)

    def drain_nodes(self, nodes: Sequence[Node], grace_s: float, what: str) -> None:
        """SIGTERM `nodes`, wait up to `grace_s` (or a kill request), SIGKILL the rest.
        A node another thread finished meanwhile (handle None) is skipped. A node the
        controller did not start is told to drain at its next sync and waited for until its
        last sync (or the grace is up: then it is forgotten, it cannot be killed from here).
        The runtime calls are made outside the lock, like the tick's."""
        lock = self.state.lock
        since = time.time()
        with lock:
            live = [n for n in nodes if n.handle is not None or self._heard_of(n)]
            for n in nodes:
                if n not in live:
                    n.state = "exited"
            for n in live:
                n.state = "draining"
            signalled = [n.handle for n in live if n.handle is not None]
        for h in signalled:
            rt = self.rt(h)
            if rt.poll(h).running:
                rt.terminate(h)
        if live:
            log.info("draining %d %s node(s), grace %.0fs", len(live), what, grace_s)
        deadline = time.monotonic() + grace_s
        while live:
            with lock:
                watched: list[tuple[Node, NodeHandle]] = []
                for n in list(live):
                    if n.handle is None and n.managed:
                        live.remove(n)
                    elif not n.managed:
                        if self._said_goodbye(n, since):
                            n.state = "exited"
                            live.remove(n)
                    else:
                        assert n.handle is not None
                        watched.append((n, n.handle))
            seen = [(n, h, self.rt(h).poll(h)) for n, h in watched]
            gone = [(n, h, st) for n, h, st in seen if not st.running]
            with lock:
                mine = [h for n, h, st in gone if self._finish_node(n, h, st.exit_code)]
            for h in mine:
                self.rt(h).release(h)
            live = [n for n in live if all(n is not g for g, _, _ in gone)]
            if not live:
                break
            if time.monotonic() >= deadline or self._kill_now.is_set():
                self._kill_nodes(live)
                break
            time.sleep(0.1)

    def _kill_nodes(self, nodes: Sequence[Node]) -> None:
        """The end of a drain's grace: SIGKILL the managed nodes, forget the others."""
        with self.state.lock:
            doomed: list[tuple[Node, NodeHandle]] = []
            for n in nodes:
                if not n.managed:
                    log.warning("%s (on %s) did not drain in time: forgotten",
                                n.name, n.host or "?")
                    n.state = "exited"
                elif n.handle is not None:
                    log.warning("%s did not drain in time: SIGKILL", n.name)
                    doomed.append((n, n.handle))
        for n, h in doomed:
            rt = self.rt(h)
            rt.kill(h)
            code = rt.poll(h).exit_code
            with self.state.lock:
                mine = self._finish_node(n, h, code)
            if mine:
                rt.release(h)

    def _heard_of(self, node: Node) -> bool:
        """A node the controller did not start that synced lately (a drain can reach it)."""
        return not node.managed and self.state.node_state(node, time.time()) != "unreachable"

    def _said_goodbye(self, node: Node, since: float) -> bool:
        report = self.state.reports.get(node.name)
        return report is not None and report.received_at >= since and (
            report.final or report.state == "exited"
        )

    def _finish_node(self, node: Node, handle: NodeHandle, code: int | None) -> bool:
        """Record the exit of `handle`, unless another thread did; True: the caller releases it
        (outside the lock)."""
        if node.handle is not handle:
            return False
        node.handle, node.exit_code, node.state = None, code, "exited"
        log.info("%s exited (code %s)", node.name, code)
        return True

    # -- probing the servers --------------------------------------------------------------

    def probe_loop(self, done: threading.Event) -> None:
        """Until `done`: health of each starting server, `Status` of each ready one."""
        while not done.is_set():
            with self.state.lock:
                targets = [
                    (n.model, n.state, n.endpoint)
                    for n in self.state.nodes.values()
                    if n.kind == "server" and n.endpoint
                    and (n.handle is not None or n.state in ("starting", "running"))
                ]
            for model, state, endpoint in targets:
                probe = self._probes.get(endpoint)
                if probe is None:
                    probe = ServerProbe(
                        endpoint, self.token, self.opts.probe_timeout_s, tls=self.state.tls
                    )
                    self._probes[endpoint] = probe
                if state == "starting":
                    ok = probe.healthy()
                    with self.state.lock:
                        self.state.healthy[model] = ok
                    if not ok:
                        continue
                status = probe.status()
                if status is not None:
                    with self.state.lock:
                        self.state.server_status[model] = status
            starting = any(state == "starting" for _, state, _ in targets)
            done.wait(min(0.25, self.opts.probe_s) if starting else self.opts.probe_s)

    def close_probes(self) -> None:
        for p in self._probes.values():
            p.close()
