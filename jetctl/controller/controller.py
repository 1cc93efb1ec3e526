"""The controller: one per run; owns the desired state and reconciles the nodes toward it.

From a Recipe and a run dir it makes the run dir and token, starts one `jetctl server` per
model on a port it picks (and reuses on restart), waits until each server wrote
`servers/<model>.json` and answers gRPC health, then starts `tasks.<t>.clients` nodes of
`jetctl client` per task. About once a second it restarts what died (exponential backoff,
reset once a node stayed up `stable_s`), keeps `run.json` current and serves the `Control`
gRPC service (`jetctl status`, `jetctl down`, `jetctl swap-clients`). It stops when
`run.duration_s` elapsed, when every model reached `train.max_steps`, or on Down / SIGINT /
SIGTERM: clients drain first, then servers (they checkpoint), then it exits. Killing the
controller leaves the nodes running; `Controller(..., resume=True)` adopts them again from
the runtime's records (pid files, container labels).

Servers run as processes; each task's clients run on its `runtime:` (process, or docker:
one container per node, see runtimes/docker.py).

A swap (`swap_clients`) starts the task's new revision beside the old one (nodes
`<task>-<index>-<rev>`, `--revision rev --name ...`, a new agent or image), waits until
each new node's `nodes/<name>.json` says running, then (with `drop_old`) tells the servers
to refuse the old revision (jetctl/revisions.py) and drains the old nodes like `down`
does. Training never pauses. The task's current revision is kept in run.json so that a
resumed controller keeps it.

Run it with `jetctl up RECIPE` (or `Controller(recipe, path).run()`). Left out: scaling
(`Scale` answers UNIMPLEMENTED).
"""

from __future__ import annotations

import json
import logging
import os
import re
import signal
import sys
import threading
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from types import FrameType
from typing import Any, Literal, Protocol

import grpc

from jetctl.controller.rundir import (
    TOKEN_ENV,
    RunDirError,
    RunPaths,
    connect_host,
    free_port,
    pid_alive,
    process_create_time,
    read_json,
    resolve_token,
    update_latest_link,
    write_json_atomic,
)
from jetctl.controller.runtimes.base import ContainerSpec, NodeHandle, NodeKind, NodeSpec, Runtime
from jetctl.controller.runtimes.process import ProcessRuntime
from jetctl.controller.service import ServerProbe, serve_control
from jetctl.proto._gen import control_pb2 as cpb
from jetctl.recipe import Recipe
from jetctl.revisions import read_refused, write_refused
from jetctl.tls import TlsError, TlsFiles, prepare_run_tls

log = logging.getLogger("jetctl.controller")

RunState = Literal["starting", "running", "stopping", "finished"]
# pending: not started yet (a client waits for its server) | starting: process up, not ready |
# running | restarting: died, waiting out its backoff | draining: SIGTERM sent | exited
NodeRunState = Literal["pending", "starting", "running", "restarting", "draining", "exited"]


@dataclass(frozen=True)
class ControllerOptions:
    tick_s: float = 1.0  # reconcile period
    grace_s: float = 30.0  # default drain time per phase (clients, then servers)
    stable_s: float = 60.0  # a node up this long gets its restart backoff reset
    plot_every_s: float = 30.0  # reward curve refresh period during the run
    probe_s: float = 1.0  # server Status poll period
    probe_timeout_s: float = 1.0


class CommandBuilder(Protocol):
    """Builds the argv of each node; tests swap in fake nodes here."""

    def server(self, model: str, port: int, metrics_port: int | None) -> list[str]: ...

    def client(
        self, task: str, index: int, revision: str, name: str | None = None,
        agent: str | None = None,
    ) -> list[str]: ...


@dataclass(frozen=True)
class JetctlCommands:
    """`jetctl server` / `jetctl client` (docs/CONTRACTS.md), run by this Python without PATH."""

    recipe: Path
    run_dir: Path
    prefix: tuple[str, ...] = (sys.executable, "-m", "jetctl.cli.main")

    def server(self, model: str, port: int, metrics_port: int | None) -> list[str]:
        argv = [*self.prefix, "server", "--recipe", str(self.recipe), "--model", model]
        argv += ["--run-dir", str(self.run_dir), "--port", str(port)]
        if metrics_port:
            argv += ["--metrics-port", str(metrics_port)]
        return argv

    def client(
        self, task: str, index: int, revision: str, name: str | None = None,
        agent: str | None = None,
    ) -> list[str]:
        argv = [*self.prefix, "client", "--recipe", str(self.recipe), "--task", task]
        argv += ["--index", str(index), "--run-dir", str(self.run_dir), "--revision", revision]
        if name is not None:
            argv += ["--name", name]
        if agent is not None:
            argv += ["--agent", agent]
        return argv


# the commands inside a client image (images/base/Dockerfile puts jetctl on PATH)
CONTAINER_PREFIX = ("jetctl",)
DEFAULT_IMAGE = "jetctl-base"
FIRST_REVISION = "r0"
_REVISION = re.compile(r"^r(\d+)$")
_ENTRY_POINT = re.compile(r"^[A-Za-z_]\w*(\.[A-Za-z_]\w*)*:[A-Za-z_]\w*$")


def client_node_name(task: str, index: int, revision: str = FIRST_REVISION) -> str:
    """The node name a client writes `nodes/<name>.json` under: `<task>-<index>` for the
    first revision, `<task>-<index>-<revision>` for the ones swapped in later."""
    return f"{task}-{index}" if revision == FIRST_REVISION else f"{task}-{index}-{revision}"


@dataclass(frozen=True)
class TaskRevision:
    """What a task's clients run now: the revision tag and what a swap replaced."""

    revision: str = FIRST_REVISION
    agent: str | None = None  # None: the recipe's agent
    image: str | None = None  # None: the recipe's image (runtime: docker)


@dataclass(frozen=True)
class SwapResult:
    ok: bool
    message: str
    revision: str = ""


def server_node_name(model: str) -> str:
    return f"server-{model}"


@dataclass
class Node:
    """One desired node and what the controller knows of it."""

    name: str
    kind: NodeKind
    model: str
    task: str = ""
    index: int = 0
    revision: str = "r0"
    state: NodeRunState = "pending"
    handle: NodeHandle | None = None
    restarts: int = 0
    backoff_s: float = 1.0
    next_start_at: float = 0.0  # monotonic
    up_since: float = 0.0  # monotonic
    exit_code: int | None = None
    last_pid: int = 0
    endpoint: str = ""  # servers: host:port
    metrics: str = ""  # servers: host:port of /metrics, from servers/<model>.json
    port: int = 0
    labels: dict[str, str] = field(default_factory=dict)
    runtime: str = "process"  # the key of the runtime that runs it
    agent: str | None = None  # clients: --agent (None: the recipe's)
    image: str | None = None  # clients on docker


class Controller:
    """Runs one recipe: `setup()`, then `serve_forever()` (or both: `run()`)."""

    def __init__(
        self,
        recipe: Recipe,
        recipe_path: Path,
        *,
        run_dir: Path | None = None,
        runtime: Runtime | None = None,
        commands: CommandBuilder | None = None,
        runtimes: Mapping[str, Runtime] | None = None,
        container_commands: CommandBuilder | None = None,
        resume: bool = False,
        latest_link: Path | None = None,
        options: ControllerOptions | None = None,
    ) -> None:
        self.recipe = recipe
        self.recipe_path = Path(recipe_path).resolve()
        self.run_dir = Path(run_dir if run_dir is not None else recipe.run_dir).resolve()
        self.paths = RunPaths(self.run_dir)
        self.runtime: Runtime = runtime or ProcessRuntime(self.run_dir)
        self.commands: CommandBuilder = commands or JetctlCommands(self.recipe_path, self.run_dir)
        # servers and process tasks run on `runtime`; docker tasks on runtimes["docker"],
        # made in setup() when a task asks for it and none was given
        self.runtimes: dict[str, Runtime] = {"process": self.runtime, **(runtimes or {})}
        self.container_commands: CommandBuilder = container_commands or JetctlCommands(
            self.recipe_path, self.run_dir, prefix=CONTAINER_PREFIX
        )
        self.resume = resume
        self.latest_link = latest_link
        self.opts = options or ControllerOptions()
        self.token = ""
        self.tls: TlsFiles | None = None  # run.tls; None: plaintext
        self.endpoint = ""
        self.started_at = time.time()
        self.stop_reason = ""

        self._lock = threading.RLock()
        self._stop = threading.Event()
        self._kill_now = threading.Event()
        self._done = threading.Event()
        self._stop_grace: float | None = None
        self._state: RunState = "starting"
        self._nodes: dict[str, Node] = {}
        self._healthy: dict[str, bool] = {}  # model -> answered health since its last start
        self._ever_ready: set[str] = set()  # models whose server was ready once
        self._server_status: dict[str, dict[str, Any]] = {}  # model -> swarm Status as dict
        self._probes: dict[str, ServerProbe] = {}
        self._grpc: grpc.Server | None = None
        self._threads: list[threading.Thread] = []
        self._plot_thread: threading.Thread | None = None
        self._plot_signature: tuple[tuple[str, float, int], ...] = ()
        self._last_run_json: dict[str, Any] | None = None
        self._revisions: dict[str, TaskRevision] = {t: TaskRevision() for t in recipe.tasks}
        self._swapping: set[str] = set()  # tasks with a swap in progress
        self._run_json_lock = threading.Lock()

    # -- lifecycle ----------------------------------------------------------------------

    def run(self) -> str:
        """Set up, reconcile until the run ends, drain. Returns why it ended."""
        self.setup()
        return self.serve_forever()

    def setup(self) -> None:
        """Run dir, token, adoption (resume), Control service, run.json. Raises RunDirError."""
        self.paths.make()
        prior = read_json(self.paths.run_json)
        self._refuse_second_controller(prior)
        if self.resume and prior is not None:
            self._revisions.update(_revisions_from_run_json(prior, self.recipe.tasks))
        self._open_runtimes()
        adopted: list[NodeHandle] = []
        for rt in self.runtimes.values():
            rt.prune(self.recipe.run.name)  # exited containers an earlier controller left
            adopted += rt.list(self.recipe.run.name)
        if adopted and not self.resume:
            names = ", ".join(
                f"{h.spec.name} ({f'pid {h.pid}' if h.pid else f'container {h.container_id:.12}'})"
                for h in adopted
            )
            raise RunDirError(
                f"nodes of an earlier controller still run in {self.run_dir}: {names}; pass "
                f"--resume to adopt them, or stop them with `jetctl down --run-dir {self.run_dir}`"
            )
        prior_ports: dict[str, int] = {}
        if self.resume and prior is not None:
            self.started_at = float(prior.get("started_at", self.started_at))
            prior_ports = _ports_from_run_json(prior)
        self.token = resolve_token(self.paths, self.recipe.run.token, create=True)
        try:
            self.tls = prepare_run_tls(self.recipe, self.run_dir)
        except TlsError as e:
            raise RunDirError(str(e)) from None
        self._build_nodes(prior_ports)
        self._adopt(adopted)
        self._grpc, port = serve_control(self, self.token, tls=self.tls)
        self.endpoint = f"127.0.0.1:{port}"
        if self.latest_link is not None:
            update_latest_link(self.latest_link, self.run_dir)
        with self._lock:
            self._state = "running"
        self._write_run_json()
        probe = threading.Thread(target=self._probe_loop, name="probe", daemon=True)
        probe.start()
        self._threads.append(probe)
        log.info("run %s in %s; control at %s", self.recipe.run.name, self.run_dir, self.endpoint)

    def serve_forever(self) -> str:
        """Reconcile until a stop condition or request, then drain. Returns the reason."""
        next_plot = time.monotonic() + self.opts.plot_every_s
        try:
            while not self._stop.is_set():
                self._reconcile()
                reason = self._finished_reason()
                if reason:
                    self.request_stop(reason)
                    break
                self._write_run_json()
                if time.monotonic() >= next_plot:
                    self._refresh_plot(wait=False)
                    next_plot = time.monotonic() + self.opts.plot_every_s
                self._stop.wait(self.opts.tick_s)
        finally:
            self._teardown()
        return self.stop_reason

    def request_stop(self, reason: str, grace_s: float | None = None) -> None:
        """Ask the run to end: drain clients, then servers (each phase up to `grace_s`)."""
        with self._lock:
            if not self._stop.is_set():
                self.stop_reason = reason
                self._stop_grace = grace_s
                log.info("stopping (%s)", reason)
            elif grace_s is not None and grace_s <= 0:
                self._kill_now.set()
            self._stop.set()

    def install_signal_handlers(self) -> None:
        """SIGTERM/SIGINT drain the run; a second one kills what still drains. Main thread only."""

        def handler(signum: int, _frame: FrameType | None) -> None:
            if self._stop.is_set():
                log.warning("second %s: killing the nodes now", signal.Signals(signum).name)
                self._kill_now.set()
            self.request_stop(signal.Signals(signum).name)

        signal.signal(signal.SIGTERM, handler)
        signal.signal(signal.SIGINT, handler)

    @property
    def done(self) -> bool:
        return self._done.is_set()

    def wait(self, timeout_s: float | None = None) -> bool:
        return self._done.wait(timeout_s)

    def _open_runtimes(self) -> None:
        """Make the docker runtime when a task needs it and check its images are built."""
        docker_tasks = [t for t, c in self.recipe.tasks.items() if c.runtime == "docker"]
        if not docker_tasks:
            return
        from jetctl.controller.runtimes.docker import DockerRuntime, RuntimeUnavailable

        try:
            if "docker" not in self.runtimes:
                self.runtimes["docker"] = DockerRuntime(self.run_dir)
            rt = self.runtimes["docker"]
            check = getattr(rt, "check_image", None)
            if check is not None:
                for image in sorted({self._image(t, self._revisions[t]) for t in docker_tasks}):
                    check(image)
        except RuntimeUnavailable as e:
            tasks = ", ".join(docker_tasks)
            raise RunDirError(f"tasks {tasks} use runtime: docker, but {e}") from None

    def _image(self, task: str, rev: TaskRevision) -> str:
        return rev.image or self.recipe.tasks[task].image or DEFAULT_IMAGE

    def _rt(self, handle: NodeHandle) -> Runtime:
        """The runtime that runs `handle` (containers: docker; the rest: the process one)."""
        if handle.container_id and "docker" in self.runtimes:
            return self.runtimes["docker"]
        return self.runtime

    # -- desired state ------------------------------------------------------------------

    def _refuse_second_controller(self, prior: dict[str, Any] | None) -> None:
        if prior is None or prior.get("state") == "finished":
            return
        ctl = prior.get("controller") or {}
        pid = int(ctl.get("pid") or 0)
        if pid and pid != os.getpid() and pid_alive(pid, float(ctl.get("create_time") or 0.0)):
            raise RunDirError(
                f"a controller (pid {pid}) already runs {self.run_dir}: watch it with "
                f"`jetctl status --run-dir {self.run_dir}`, stop it with `jetctl down`"
            )

    def _build_nodes(self, prior_ports: dict[str, int]) -> None:
        run = self.recipe.run
        for model, mcfg in self.recipe.models.items():
            port = mcfg.port or prior_ports.get(model) or free_port(mcfg.host)
            node = Node(
                name=server_node_name(model),
                kind="server",
                model=model,
                port=port,
                endpoint=f"{connect_host(mcfg.host)}:{port}",
                backoff_s=run.restart_backoff_s,
                labels={"jetctl.run": run.name, "jetctl.kind": "server", "jetctl.model": model},
            )
            self._nodes[node.name] = node
        for task, tcfg in self.recipe.tasks.items():
            for i in range(tcfg.clients):
                node = self._client_node(task, i, self._revisions[task])
                self._nodes[node.name] = node

    def _client_node(self, task: str, index: int, rev: TaskRevision) -> Node:
        tcfg = self.recipe.tasks[task]
        node = Node(
            name=client_node_name(task, index, rev.revision),
            kind="client",
            model=tcfg.model,
            task=task,
            index=index,
            revision=rev.revision,
            backoff_s=self.recipe.run.restart_backoff_s,
            runtime=tcfg.runtime,
            agent=rev.agent,
            image=self._image(task, rev) if tcfg.runtime == "docker" else None,
        )
        node.labels = self._client_labels(node)
        return node

    def _client_labels(self, node: Node) -> dict[str, str]:
        return {
            "jetctl.run": self.recipe.run.name,
            "jetctl.kind": "client",
            "jetctl.task": node.task,
            "jetctl.revision": node.revision,
        }

    def _adopt(self, handles: Sequence[NodeHandle]) -> None:
        extras: list[NodeHandle] = []
        now = time.monotonic()
        for h in handles:
            node = self._nodes.get(h.spec.name)
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
                mine = [h for h in extras if self._rt(h) is rt]
                rt.stop_all(mine, self.opts.grace_s)
                for h in mine:
                    rt.release(h)

    def _spec(self, node: Node) -> NodeSpec:
        if node.kind == "server":
            mcfg = self.recipe.models[node.model]
            argv = self.commands.server(node.model, node.port, mcfg.metrics_port or None)
        else:
            commands = self.container_commands if node.runtime == "docker" else self.commands
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
            env={TOKEN_ENV: self.token},
            labels=dict(node.labels),
            container=self._container_spec(node) if node.runtime == "docker" else None,
        )

    def _container_spec(self, node: Node) -> ContainerSpec:
        res = self.recipe.tasks[node.task].resources
        mounts: list[tuple[Path, bool]] = [(self.recipe_path, True)]
        if self.tls is not None and not self.tls.dir.resolve().is_relative_to(self.run_dir):
            mounts.append((self.tls.dir.resolve(), True))
        return ContainerSpec(
            image=node.image or DEFAULT_IMAGE,
            cpus=res.cpus,
            memory=res.memory,
            pids=res.pids,
            shm=res.shm,
            mounts=tuple(mounts),
            docker_socket=self.recipe.tasks[node.task].docker_socket,
        )

    # -- the reconcile loop -------------------------------------------------------------

    def _reconcile(self) -> None:
        now = time.monotonic()
        with self._lock:
            for node in self._nodes.values():
                if node.handle is not None and node.state in ("starting", "running"):
                    st = self._rt(node.handle).poll(node.handle)
                    if not st.running:
                        self._on_exit(node, st.exit_code, now)
                    elif node.state == "starting" and self._ready(node):
                        node.state = "running"
                        if node.kind == "server":
                            self._ever_ready.add(node.model)
                            srv = read_json(self.paths.server_file(node.model)) or {}
                            node.metrics = str(srv.get("metrics", ""))
                        log.info("%s is up (pid %s)", node.name, node.last_pid)
                elif node.state == "restarting" and now >= node.next_start_at:
                    self._start(node, restart=True)
                elif node.state == "pending" and (
                    node.kind == "server" or node.model in self._ever_ready
                ):
                    self._start(node, restart=False)

    def _ready(self, node: Node) -> bool:
        if node.kind == "client":
            return True
        return self._healthy.get(node.model, False) and self.paths.server_file(node.model).is_file()

    def _start(self, node: Node, restart: bool) -> None:
        if restart:
            node.restarts += 1
        if node.kind == "server":
            self._healthy[node.model] = False
            self.paths.server_file(node.model).unlink(missing_ok=True)
        try:
            handle = self.runtimes[node.runtime].start(self._spec(node))
        except OSError as e:
            log.error("could not start %s: %s", node.name, e)
            self._schedule_restart(node, time.monotonic())
            return
        node.handle, node.last_pid = handle, handle.pid or 0
        node.state, node.up_since, node.exit_code = "starting", time.monotonic(), None
        verb = f"restarted (restart {node.restarts})" if restart else "started"
        log.info("%s %s, pid %s", node.name, verb, handle.pid)

    def _on_exit(self, node: Node, code: int | None, now: float) -> None:
        assert node.handle is not None
        self._rt(node.handle).release(node.handle)
        node.handle, node.exit_code = None, code
        if node.kind == "server":
            self._healthy[node.model] = False
            if code == 0 and self._reached_max_steps(node.model):
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

    # -- rolling swap ---------------------------------------------------------------------

    def swap_clients(
        self,
        task: str,
        *,
        image: str | None = None,
        agent: str | None = None,
        grace_s: float | None = None,
        drop_old: bool = False,
        healthy_timeout_s: float = 180.0,
    ) -> SwapResult:
        """Replace `task`'s client nodes by a new revision without pausing training.

        Start the new revision's nodes beside the old ones; once every new node reports
        `running` in `nodes/<name>.json` (it registered with its server), refuse the old
        revision at the servers (`drop_old`) and drain the old nodes (SIGTERM: they finish
        or time out their rollouts and flush their spools, up to `grace_s`, then SIGKILL).
        If the new nodes do not come up within `healthy_timeout_s` (or keep crashing), they
        are removed and the old revision keeps running. Blocks until done."""
        problem = self._swap_problem(task, image, agent)
        if problem:
            return SwapResult(False, problem)
        with self._lock:
            if task in self._swapping:
                return SwapResult(False, f"a swap of task {task!r} is already in progress")
            self._swapping.add(task)
        try:
            grace = self.opts.grace_s if grace_s is None or grace_s <= 0 else grace_s
            return self._swap(task, image, agent, grace, drop_old, healthy_timeout_s)
        finally:
            with self._lock:
                self._swapping.discard(task)

    def _swap_problem(self, task: str, image: str | None, agent: str | None) -> str:
        if task not in self.recipe.tasks:
            known = ", ".join(sorted(self.recipe.tasks)) or "none"
            return f"task {task!r} is not in the recipe (tasks: {known})"
        if self._state != "running" or self._stop.is_set():
            return f"the run is {self._state if not self._stop.is_set() else 'stopping'}: no swap"
        if not image and not agent:
            return "pass --image IMAGE (runtime: docker) or --agent module:function"
        if agent and not _ENTRY_POINT.match(agent):
            return f"--agent {agent!r} must be module:function, e.g. agents.web:agent"
        runtime = self.recipe.tasks[task].runtime
        if image:
            if runtime != "docker":
                return (
                    f"--image needs runtime: docker, and task {task!r} runs as {runtime}: "
                    "pass --agent instead"
                )
            check = getattr(self.runtimes.get("docker"), "check_image", None)
            if check is not None:
                from jetctl.controller.runtimes.docker import RuntimeUnavailable

                try:
                    check(image)
                except RuntimeUnavailable as e:
                    return str(e)
        return ""

    def _next_revision(self) -> str:
        """r<N+1>, N the highest revision number of the run (revisions are run-wide)."""
        numbers = [0]
        for rev in [r.revision for r in self._revisions.values()] + [
            n.revision for n in self._nodes.values()
        ]:
            m = _REVISION.match(rev)
            if m:
                numbers.append(int(m.group(1)))
        return f"r{max(numbers) + 1}"

    def _swap(
        self, task: str, image: str | None, agent: str | None, grace_s: float, drop_old: bool,
        healthy_timeout_s: float,
    ) -> SwapResult:
        with self._lock:
            old_rev = self._revisions[task]
            new_rev = TaskRevision(
                revision=self._next_revision(),
                agent=agent or old_rev.agent,
                image=image or old_rev.image,
            )
            old = [n for n in self._nodes.values() if n.kind == "client" and n.task == task]
            new = [
                self._client_node(task, i, new_rev) for i in range(self.recipe.tasks[task].clients)
            ]
            for n in new:
                self._nodes[n.name] = n  # pending: the reconcile loop starts them
        log.info("swap %s: starting %s (%d node(s)) beside %s", task, new_rev.revision,
                 len(new), old_rev.revision)
        since = time.time()
        problem = self._wait_healthy(new, since, healthy_timeout_s)
        if problem:
            log.error("swap %s to %s failed: %s; keeping %s", task, new_rev.revision, problem,
                      old_rev.revision)
            self._retire(new, grace_s=5.0)
            return SwapResult(
                False, f"{problem}; the old revision {old_rev.revision} keeps running",
                new_rev.revision,
            )
        with self._lock:
            self._revisions[task] = new_rev
        self._write_run_json()
        old_revisions = sorted({n.revision for n in old} | {old_rev.revision})
        refused_note = ""
        if drop_old:
            model = self.recipe.tasks[task].model
            entries = {f"{task}/{r}" for r in old_revisions}
            if not self._refuse(model, entries):
                refused_note = f" (server {model} has not confirmed the refusal yet)"
        self._retire(old, grace_s)
        leftovers = self._spool_leftovers(old)
        msg = (
            f"task {task}: {len(new)} node(s) of {new_rev.revision} running; "
            f"{len(old)} node(s) of {', '.join(old_revisions)} drained"
        )
        if drop_old:
            msg += f"; {', '.join(old_revisions)} refused by the server{refused_note}"
        if leftovers:
            msg += f"; un-acked groups left in spool/: {leftovers}"
        log.info("swap %s", msg)
        return SwapResult(True, msg, new_rev.revision)

    def _wait_healthy(self, nodes: Sequence[Node], since: float, timeout_s: float) -> str:
        """'' once every node runs and its status file says running; else why not."""
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if self._stop.is_set():
                return "the run is stopping"
            with self._lock:
                crashing = [n.name for n in nodes if n.restarts >= 2]
                up = [n for n in nodes if n.state == "running"]
            if crashing:
                return (
                    f"new node(s) {', '.join(crashing)} keep exiting: see "
                    f"{self.paths.logs}/{crashing[0]}.log"
                )
            if len(up) == len(nodes) and all(self._reports_running(n, since) for n in nodes):
                return ""
            time.sleep(0.2)
        waiting = [n.name for n in nodes if not self._reports_running(n, since)]
        return (
            f"new node(s) {', '.join(waiting)} did not report running within {timeout_s:.0f}s: "
            f"see {self.paths.logs}/{waiting[0] if waiting else nodes[0].name}.log"
        )

    def _reports_running(self, node: Node, since: float) -> bool:
        info = read_json(self.paths.node_file(node.name)) or {}
        fresh = float(info.get("updated_at") or 0.0) >= since
        return fresh and info.get("state") == "running"

    def _retire(self, nodes: Sequence[Node], grace_s: float) -> None:
        """Drain `nodes` and forget them: the controller no longer restarts or lists them."""
        self._drain_nodes(nodes, grace_s, "old client")
        with self._lock:
            for n in nodes:
                if n.handle is None and self._nodes.get(n.name) is n:
                    del self._nodes[n.name]
        self._write_run_json()

    def _refuse(self, model: str, entries: set[str], timeout_s: float = 10.0) -> bool:
        """Tell `model`'s server to refuse `entries` (jetctl/revisions.py); True once its
        servers/<model>.json shows it enforces them."""
        write_refused(self.run_dir, model, read_refused(self.run_dir, model) | entries)
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            srv = read_json(self.paths.server_file(model)) or {}
            if entries <= set(srv.get("refused_revisions") or ()):
                return True
            time.sleep(0.2)
        log.warning("server %s did not confirm refusing %s within %.0fs", model,
                    sorted(entries), timeout_s)
        return False

    def _spool_leftovers(self, nodes: Sequence[Node]) -> dict[str, int]:
        """Groups the drained nodes could not flush (their nodes/<name>.json spool_depth)."""
        left: dict[str, int] = {}
        for n in nodes:
            depth = int((read_json(self.paths.node_file(n.name)) or {}).get("spool_depth") or 0)
            if depth:
                left[n.name] = depth
        return left

    # -- stop conditions ----------------------------------------------------------------

    def _finished_reason(self) -> str:
        duration = self.recipe.run.duration_s
        if duration is not None and time.time() - self.started_at >= duration:
            return f"duration_s ({duration:g}s) elapsed"
        if self.recipe.models and all(self._reached_max_steps(m) for m in self.recipe.models):
            return "every model reached train.max_steps"
        with self._lock:
            servers = [n for n in self._nodes.values() if n.kind == "server"]
            if servers and all(n.state == "exited" for n in servers):
                return "every server exited"
        return ""

    def _reached_max_steps(self, model: str) -> bool:
        max_steps = self.recipe.models[model].train.max_steps
        if max_steps is None:
            return False
        with self._lock:
            version = int((self._server_status.get(model) or {}).get("model_version", 0))
        return version >= max_steps

    # -- drain ----------------------------------------------------------------------------

    def _teardown(self) -> None:
        with self._lock:
            self._state = "stopping"
        self._write_run_json()
        grace = self._stop_grace if self._stop_grace is not None else self.opts.grace_s
        try:
            for kind in ("client", "server"):
                self._drain(kind, grace)
            for rt in self.runtimes.values():
                rt.prune(self.recipe.run.name)
        finally:
            self._refresh_plot(wait=True)
            with self._lock:
                self._state = "finished"
            self._write_run_json()
            self._done.set()
            for t in self._threads:
                t.join(timeout=5)
            for p in self._probes.values():
                p.close()
            if self._grpc is not None:
                self._grpc.stop(grace=1.0)
            log.info("run %s finished: %s", self.recipe.run.name, self.stop_reason)

    def _drain(self, kind: NodeKind, grace_s: float) -> None:
        """SIGTERM every node of `kind`, wait up to `grace_s` (or a kill request), SIGKILL the rest."""
        with self._lock:
            nodes = [n for n in self._nodes.values() if n.kind == kind]
        self._drain_nodes(nodes, grace_s, kind)

    def _drain_nodes(self, nodes: Sequence[Node], grace_s: float, what: str) -> None:
        """SIGTERM `nodes`, wait up to `grace_s` (or a kill request), SIGKILL the rest.
        A node another thread finished meanwhile (handle None) is skipped."""
        with self._lock:
            live = [n for n in nodes if n.handle is not None]
            for n in nodes:
                if n.handle is None:
                    n.state = "exited"
            for n in live:
                assert n.handle is not None
                rt = self._rt(n.handle)
                if rt.poll(n.handle).running:
                    rt.terminate(n.handle)
                n.state = "draining"
        if live:
            log.info("draining %d %s node(s), grace %.0fs", len(live), what, grace_s)
        deadline = time.monotonic() + grace_s
        while live:
            with self._lock:
                for n in list(live):
                    if n.handle is None:
                        live.remove(n)
                        continue
                    st = self._rt(n.handle).poll(n.handle)
                    if not st.running:
                        self._finish_node(n, st.exit_code)
                        live.remove(n)
            if not live:
                break
            if time.monotonic() >= deadline or self._kill_now.is_set():
                with self._lock:
                    for n in live:
                        if n.handle is None:
                            continue
                        log.warning("%s did not drain in time: SIGKILL", n.name)
                        rt = self._rt(n.handle)
                        rt.kill(n.handle)
                        self._finish_node(n, rt.poll(n.handle).exit_code)
                break
            time.sleep(0.1)

    def _finish_node(self, node: Node, code: int | None) -> None:
        assert node.handle is not None
        self._rt(node.handle).release(node.handle)
        node.handle, node.exit_code, node.state = None, code, "exited"
        log.info("%s exited (code %s)", node.name, code)

    # -- probing the servers ---------------------------------------------------------------

    def _probe_loop(self) -> None:
        while not self._done.is_set():
            with self._lock:
                targets = [
                    (n.model, n.state, n.endpoint)
                    for n in self._nodes.values()
                    if n.kind == "server" and n.handle is not None
                ]
            for model, state, endpoint in targets:
                probe = self._probes.get(endpoint)
                if probe is None:
                    probe = ServerProbe(
                        endpoint, self.token, self.opts.probe_timeout_s, tls=self.tls
                    )
                    self._probes[endpoint] = probe
                if state == "starting":
                    ok = probe.healthy()
                    with self._lock:
                        self._healthy[model] = ok
                    if not ok:
                        continue
                status = probe.status()
                if status is not None:
                    with self._lock:
                        self._server_status[model] = status
            starting = any(state == "starting" for _, state, _ in targets)
            self._done.wait(min(0.25, self.opts.probe_s) if starting else self.opts.probe_s)

    # -- status and run.json ----------------------------------------------------------------

    def status(self) -> cpb.RunStatusReply:
        """The `Control.Status` reply: every node with its state and its own figures."""
        with self._lock:
            rows = [
                (
                    n,
                    n.handle.pid if n.handle else n.last_pid,
                    n.handle.container_id if n.handle else None,
                    n.state,
                    n.restarts,
                )
                for n in self._nodes.values()
            ]
            server_json = {m: json.dumps(s, sort_keys=True) for m, s in self._server_status.items()}
            state = self._state
        nodes = []
        for n, pid, cid, nstate, restarts in rows:
            if n.kind == "server":
                figures = server_json.get(n.model, "{}")
            else:
                figures = _read_text(self.paths.node_file(n.name)) or "{}"
            nodes.append(
                cpb.NodeStatus(
                    name=n.name,
                    kind=n.kind,
                    task=n.task,
                    model=n.model,
                    state=nstate,
                    pid=pid or 0,
                    container_id=cid or "",
                    restarts=restarts,
                    endpoint=n.endpoint,
                    revision=n.revision if n.kind == "client" else "",
                    json=figures,
                )
            )
        return cpb.RunStatusReply(
            run=self.recipe.run.name,
            run_dir=str(self.run_dir),
            uptime_s=max(0.0, time.time() - self.started_at),
            nodes=nodes,
            state=state,
        )

    def run_json(self) -> dict[str, Any]:
        """run.json as docs/CONTRACTS.md describes it (plus `state` and the controller's
        process start time, which guards against a recycled pid)."""
        with self._lock:
            servers = {
                n.model: {"endpoint": n.endpoint, "metrics": n.metrics, "pid": n.last_pid or None}
                for n in self._nodes.values()
                if n.kind == "server"
            }
            clients: dict[str, dict[str, Any]] = {}
            for n in self._nodes.values():
                if n.kind != "client":
                    continue
                entry: dict[str, Any] = {"task": n.task, "revision": n.revision}
                if n.handle is not None and n.handle.container_id:
                    entry["container_id"] = n.handle.container_id
                else:
                    entry["pid"] = n.last_pid or None
                clients[n.name] = entry
            tasks = {
                t: {"revision": r.revision, "agent": r.agent, "image": r.image}
                for t, r in self._revisions.items()
            }
            state = self._state
        return {
            "run": self.recipe.run.name,
            "recipe": str(self.recipe_path),
            "run_dir": str(self.run_dir),
            "controller": {
                "pid": os.getpid(),
                "endpoint": self.endpoint,
                "create_time": process_create_time(os.getpid()),
            },
            "servers": servers,
            "clients": clients,
            "started_at": self.started_at,
            "tasks": tasks,
            "tls": self.tls.to_json() if self.tls is not None else None,
            "state": state,
        }

    def _write_run_json(self) -> None:
        # the reconcile loop and a swap (a Control thread) both write it; one at a time
        with self._run_json_lock:
            data = self.run_json()
            if data != self._last_run_json:
                write_json_atomic(self.paths.run_json, data)
                self._last_run_json = data

    # -- reward curve ---------------------------------------------------------------------

    def _refresh_plot(self, wait: bool) -> None:
        if self._plot_thread is not None and self._plot_thread.is_alive():
            if not wait:
                return
            self._plot_thread.join()
        signature = _metrics_signature(self.paths.metrics)
        if not signature or signature == self._plot_signature:
            return
        self._plot_signature = signature
        self._plot_thread = threading.Thread(target=self._write_plot, name="plot", daemon=True)
        self._plot_thread.start()
        if wait:
            self._plot_thread.join()

    def _write_plot(self) -> None:
        from jetctl.plot import write_reward_curve

        try:
            write_reward_curve(self.run_dir)
        except (OSError, ValueError) as e:
            log.error("could not write the reward curve: %s", e)


def _revisions_from_run_json(
    prior: dict[str, Any], tasks: Mapping[str, object]
) -> dict[str, TaskRevision]:
    """Each task's current revision as an earlier controller left it (after swaps)."""
    out: dict[str, TaskRevision] = {}
    for task, entry in (prior.get("tasks") or {}).items():
        if task in tasks and isinstance(entry, dict) and entry.get("revision"):
            out[task] = TaskRevision(
                revision=str(entry["revision"]),
                agent=entry.get("agent") or None,
                image=entry.get("image") or None,
            )
    return out


def _ports_from_run_json(prior: dict[str, Any]) -> dict[str, int]:
    ports: dict[str, int] = {}
    for model, entry in (prior.get("servers") or {}).items():
        endpoint = str((entry or {}).get("endpoint", ""))
        _, _, port = endpoint.rpartition(":")
        if port.isdigit():
            ports[model] = int(port)
    return ports


def _metrics_signature(metrics_dir: Path) -> tuple[tuple[str, float, int], ...]:
    out = []
    for p in sorted(metrics_dir.glob("*.steps.jsonl")):
        try:
            st = p.stat()
        except OSError:
            continue
        out.append((p.name, st.st_mtime, st.st_size))
    return tuple(out)


def _read_text(path: Path) -> str | None:
    try:
        return path.read_text()
    except OSError:
        return None
