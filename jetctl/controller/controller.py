"""The controller: one per run; owns the desired state and reconciles the nodes toward it.

From a Recipe and a run dir it makes the run dir and token, starts one `jetctl server` per
model on a port it picks (and reuses on restart), waits until each server wrote
`servers/<model>.json` and answers gRPC health, then starts `tasks.<t>.clients` nodes of
`jetctl client` per task. About once a second it restarts what died (exponential backoff,
reset once a node stayed up `stable_s`), keeps `run.json` current and serves the `Control`
gRPC service (`jetctl status`, `jetctl down`). It stops when `run.duration_s` elapsed, when
every model reached `train.max_steps`, or on Down / SIGINT / SIGTERM: clients drain first,
then servers (they checkpoint), then it exits. Killing the controller leaves the nodes
running; `Controller(..., resume=True)` adopts them again from the runtime's records.

Run it with `jetctl up RECIPE` (or `Controller(recipe, path).run()`). Left out for now:
rolling client swaps and scaling (`SwapClients`/`Scale` answer UNIMPLEMENTED); nodes carry
a revision so a swap can start revision r1 beside r0 and then drain r0.
"""

from __future__ import annotations

import json
import logging
import os
import signal
import sys
import threading
import time
from collections.abc import Sequence
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
from jetctl.controller.runtimes.base import NodeHandle, NodeKind, NodeSpec, Runtime
from jetctl.controller.runtimes.process import ProcessRuntime
from jetctl.controller.service import ServerProbe, serve_control
from jetctl.proto._gen import control_pb2 as cpb
from jetctl.recipe import Recipe

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

    def client(self, task: str, index: int, revision: str) -> list[str]: ...


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

    def client(self, task: str, index: int, revision: str) -> list[str]:
        argv = [*self.prefix, "client", "--recipe", str(self.recipe), "--task", task]
        argv += ["--index", str(index), "--run-dir", str(self.run_dir), "--revision", revision]
        return argv


def client_node_name(task: str, index: int) -> str:
    """The node name a client writes `nodes/<name>.json` under."""
    return f"{task}-{index}"


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
        self.resume = resume
        self.latest_link = latest_link
        self.opts = options or ControllerOptions()
        self.token = ""
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

    # -- lifecycle ----------------------------------------------------------------------

    def run(self) -> str:
        """Set up, reconcile until the run ends, drain. Returns why it ended."""
        self.setup()
        return self.serve_forever()

    def setup(self) -> None:
        """Run dir, token, adoption (resume), Control service, run.json. Raises RunDirError."""
        unsupported = [t for t, c in self.recipe.tasks.items() if c.runtime != self.runtime.name]
        if unsupported:
            raise RunDirError(
                f"tasks {', '.join(unsupported)} ask for another runtime than "
                f"{self.runtime.name!r}, which this controller does not run yet: "
                f"set runtime: {self.runtime.name}"
            )
        self.paths.make()
        prior = read_json(self.paths.run_json)
        self._refuse_second_controller(prior)
        adopted = self.runtime.list(self.recipe.run.name)
        if adopted and not self.resume:
            names = ", ".join(f"{h.spec.name} (pid {h.pid})" for h in adopted)
            raise RunDirError(
                f"nodes of an earlier controller still run in {self.run_dir}: {names}; pass "
                f"--resume to adopt them, or stop them with `jetctl down --run-dir {self.run_dir}`"
            )
        prior_ports: dict[str, int] = {}
        if self.resume and prior is not None:
            self.started_at = float(prior.get("started_at", self.started_at))
            prior_ports = _ports_from_run_json(prior)
        self.token = resolve_token(self.paths, self.recipe.run.token, create=True)
        self._build_nodes(prior_ports)
        self._adopt(adopted)
        self._grpc, port = serve_control(self, self.token)
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
                node = Node(
                    name=client_node_name(task, i),
                    kind="client",
                    model=tcfg.model,
                    task=task,
                    index=i,
                    backoff_s=run.restart_backoff_s,
                )
                node.labels = self._client_labels(node)
                self._nodes[node.name] = node

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
            self.runtime.stop_all(extras, self.opts.grace_s)
            for h in extras:
                self.runtime.release(h)

    def _spec(self, node: Node) -> NodeSpec:
        if node.kind == "server":
            mcfg = self.recipe.models[node.model]
            argv = self.commands.server(node.model, node.port, mcfg.metrics_port or None)
        else:
            argv = self.commands.client(node.task, node.index, node.revision)
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
        )

    # -- the reconcile loop -------------------------------------------------------------

    def _reconcile(self) -> None:
        now = time.monotonic()
        with self._lock:
            for node in self._nodes.values():
                if node.handle is not None and node.state in ("starting", "running"):
                    st = self.runtime.poll(node.handle)
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
            handle = self.runtime.start(self._spec(node))
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
        self.runtime.release(node.handle)
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
            live = [n for n in nodes if n.handle is not None]
            for n in nodes:
                if n.handle is None:
                    n.state = "exited"
            for n in live:
                assert n.handle is not None
                if self.runtime.poll(n.handle).running:
                    self.runtime.terminate(n.handle)
                n.state = "draining"
        if live:
            log.info("draining %d %s node(s), grace %.0fs", len(live), kind, grace_s)
        deadline = time.monotonic() + grace_s
        while live:
            with self._lock:
                for n in list(live):
                    assert n.handle is not None
                    st = self.runtime.poll(n.handle)
                    if not st.running:
                        self._finish_node(n, st.exit_code)
                        live.remove(n)
            if not live:
                break
            if time.monotonic() >= deadline or self._kill_now.is_set():
                with self._lock:
                    for n in live:
                        assert n.handle is not None
                        log.warning("%s did not drain in time: SIGKILL", n.name)
                        self.runtime.kill(n.handle)
                        self._finish_node(n, self.runtime.poll(n.handle).exit_code)
                break
            time.sleep(0.1)

    def _finish_node(self, node: Node, code: int | None) -> None:
        assert node.handle is not None
        self.runtime.release(node.handle)
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
                    probe = ServerProbe(endpoint, self.token, self.opts.probe_timeout_s)
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
            "state": state,
        }

    def _write_run_json(self) -> None:
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
