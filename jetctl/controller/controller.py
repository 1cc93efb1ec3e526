"""The controller: one per run; owns the desired state and reconciles the nodes toward it.

From a Recipe and a run dir it makes the run dir and token, starts one `jetctl server` per
model on a port it picks (and reuses on restart), waits until each server wrote
`servers/<model>.json` and answers gRPC health, then starts `tasks.<t>.clients` nodes of
`jetctl client` per task. About once a second it restarts what died, keeps `run.json`
current and serves the `Control` gRPC service (`jetctl status`, `jetctl down`, `jetctl
swap-clients`). It stops when `run.duration_s` elapsed, when every model reached
`train.max_steps`, or on Down / SIGINT / SIGTERM: clients drain first, then servers (they
checkpoint), then it exits. A task whose model reached `train.max_steps` while another
model still trains has its client nodes drained on their own (`_retire_finished_tasks`). Killing the controller leaves the nodes running;
`Controller(..., resume=True)` adopts them again from the runtime's records (pid files,
container labels).

This module is the run's lifecycle (set up, loop, stop, tear down); the parts it composes
change for their own reasons:

* `state.RunState`: what the controller knows (nodes, server figures, revisions, phase) under
  one lock, and the two views made of it: the `Control.Status` reply and run.json;
* `reconcile.Reconciler`: starting, restarting, adopting, draining nodes through runtimes,
  and probing the servers;
* `swap.Swapper`: rolling swaps of a task's clients to a new revision;
* `hub.Hub`: the nodes' `Join` and `Sync` (from any host), which feed the run state and the
  copy of every node's ledger journal (`received.Received`, `<run_dir>/received.sqlite`).

The Control service listens on `run.control.host:port` (a free port, reused on `--resume`)
and is advertised to nodes on other hosts as `run.control.advertise`.

Run it with `jetctl up RECIPE` (or `Controller(recipe, path).run()`). Left out: scaling
(`Scale` answers UNIMPLEMENTED).
"""

from __future__ import annotations

import json
import logging
import os
import signal
import threading
import time
from collections.abc import Mapping
from pathlib import Path
from types import FrameType
from typing import Any

import grpc

from jetctl.controller.hub import Hub
from jetctl.controller.received import Received
from jetctl.controller.reconcile import (
    CONTAINER_PREFIX,
    CommandBuilder,
    ControllerOptions,
    JetctlCommands,
    Reconciler,
)
from jetctl.controller.rows import Lease, RowLeases, RowsCall
from jetctl.controller.runtimes.base import NodeHandle, NodeKind, Runtime
from jetctl.controller.runtimes.process import ProcessRuntime
from jetctl.controller.service import serve_control
from jetctl.controller.state import RunState
from jetctl.controller.swap import Swapper, SwapResult
from jetctl.net import WILDCARDS, connect_host
from jetctl.proctree import pid_alive
from jetctl.proto._gen import control_pb2 as cpb
from jetctl.recipe import Recipe
from jetctl.rundir import (
    RunDirError,
    RunPaths,
    read_json,
    resolve_token,
    update_latest_link,
)
from jetctl.tls import TlsError, TlsFiles, prepare_run_tls

log = logging.getLogger("jetctl.controller")

__all__ = ["CommandBuilder", "Controller", "ControllerOptions", "JetctlCommands", "SwapResult"]


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
        self.resume = resume
        self.latest_link = latest_link
        self.opts = options or ControllerOptions()
        self.token = ""
        self.stop_reason = ""
        self.refused_calls: dict[str, int] = {}  # Control calls refused, by reason (service.py)

        self._stop = threading.Event()
        self._kill_now = threading.Event()
        self._done = threading.Event()
        self._stop_grace: float | None = None
        self._grpc: grpc.Server | None = None
        self._threads: list[threading.Thread] = []
        self._retired_tasks: set[str] = set()  # tasks whose model finished (train.max_steps)
        self._plot_thread: threading.Thread | None = None
        self._plot_signature: tuple[tuple[str, float, int], ...] = ()

        self.state = RunState(recipe, self.recipe_path, self.paths)
        self.reconciler = Reconciler(
            self.state,
            runtime=runtime or ProcessRuntime(self.run_dir),
            runtimes=runtimes or {},
            commands=commands or JetctlCommands(self.recipe_path, self.run_dir),
            container_commands=container_commands
            or JetctlCommands(self.recipe_path, self.run_dir, prefix=CONTAINER_PREFIX),
            options=self.opts,
            kill_now=self._kill_now,
        )
        self.swapper = Swapper(self.state, self.reconciler, self._stop, self.opts.grace_s)
        self.received: Received | None = None  # opened by setup
        self.rows = RowLeases(self.paths.rows)  # dataset tasks' positions (rows.py)
        self._hub: Hub | None = None

    @property
    def hub(self) -> Hub:
        assert self._hub is not None, "setup() first"
        return self._hub

    def revoked(self, node: str) -> bool:
        """Whether `node`'s credential is revoked: a swap drained it out of the run."""
        return node in self.state.retired

    @property
    def endpoint(self) -> str:
        """host:port of this run's Control service ('' before setup)."""
        return self.state.endpoint

    @property
    def tls(self) -> TlsFiles | None:
        return self.state.tls

    @property
    def started_at(self) -> float:
        return self.state.started_at

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
        prior_ports = self.state.adopt_prior(prior) if self.resume and prior is not None else {}
        prior_control = _control_port(prior) if self.resume else 0
        self.reconciler.open_runtimes()
        adopted = self.reconciler.list_running()  # exited containers an earlier one left: pruned
        if adopted and not self.resume:
            raise RunDirError(
                f"nodes of an earlier controller still run in {self.run_dir}: "
                f"{_describe(adopted)}; pass --resume to adopt them, or stop them with "
                f"`jetctl down --run-dir {self.run_dir}`"
            )
        self.token = resolve_token(self.paths, self.recipe.run.token, create=True)
        self.reconciler.token = self.token
        try:
            # the run's docker network gateway: where client containers dial
            gateway = self.reconciler.container_gateway()
            self.state.tls = prepare_run_tls(
                self.recipe, self.run_dir, extra_hosts=[gateway] if gateway else []
            )
        except TlsError as e:
            raise RunDirError(str(e)) from None
        self.reconciler.build_nodes(prior_ports)
        self.reconciler.adopt(adopted)
        self.received = Received(self.paths.received)
        self._hub = Hub(self.state, self.received)
        self._serve_control(prior_control)
        if self.latest_link is not None:
            update_latest_link(self.latest_link, self.run_dir)
        with self.state.lock:
            self.state.phase = "running"
        self.state.write_run_json()
        probe = threading.Thread(
            target=self.reconciler.probe_loop, args=(self._done,), name="probe", daemon=True
        )
        probe.start()
        self._threads.append(probe)
        log.info("run %s in %s; control at %s", self.recipe.run.name, self.run_dir, self.endpoint)

    def serve_forever(self) -> str:
        """Reconcile until a stop condition or request, then drain. Returns the reason."""
        next_plot = time.monotonic() + self.opts.plot_every_s
        try:
            while not self._stop.is_set():
                self.reconciler.tick()
                reason = self._finished_reason()
                if reason:
                    self.request_stop(reason)
                    break
                self._retire_finished_tasks()
                self.state.write_run_json()
                self.state.write_node_files()
                if time.monotonic() >= next_plot:
                    self._refresh_plot(wait=False)
                    next_plot = time.monotonic() + self.opts.plot_every_s
                self._stop.wait(self.opts.tick_s)
        finally:
            self._teardown()
        return self.stop_reason

    def request_stop(self, reason: str, grace_s: float | None = None) -> None:
        """Ask the run to end: drain clients, then servers (each phase up to `grace_s`)."""
        with self.state.lock:
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

    def _serve_control(self, prior_port: int) -> None:
        """Listen on run.control (the port an earlier controller of this run had, so that
        its nodes find this one; else a free one)."""
        cfg = self.recipe.run.control
        wanted = [cfg.port] if cfg.port else [p for p in (prior_port,) if p] + [0]
        port = 0
        for want in wanted:
            gateway = self.reconciler.container_gateway()
            self._grpc, port = serve_control(
                self, self.token, host=cfg.host, tls=self.state.tls, port=want,
                also=[gateway] if gateway else [],
            )
            if port:
                break
        if not port:
            raise RunDirError(f"cannot listen on {cfg.host}:{wanted[-1]} (run.control): "
                              "is the port taken, is the address this host's?")
        local = connect_host(cfg.host)
        self.reconciler.control = f"{local}:{port}"  # what nodes on this host dial
        self.state.endpoint = f"{self._advertised(cfg.host, cfg.advertise)}:{port}"

    def _advertised(self, host: str, advertise: str | None) -> str:
        if advertise or host not in WILDCARDS:
            return advertise or host
        ray = self.reconciler.runtimes.get("ray")
        node_ip = getattr(ray, "node_ip", None)
        return str(node_ip) if node_ip else "127.0.0.1"

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

    # -- what the Control service asks --------------------------------------------------

    def status(self) -> cpb.RunStatusReply:
        """The `Control.Status` reply: every node with its state and its own figures, and
        each dataset task's position."""
        reply = self.state.status()
        for task, progress in self.rows.progress().items():
            reply.rows_json[task] = json.dumps(progress, sort_keys=True)
        return reply

    def lease_rows(self, call: RowsCall) -> Lease:
        """`Control.Rows`: what a node that is gone held returns to the pool (rows.py)."""
        def gone(node: str) -> bool:
            with self.state.lock:
                n = self.state.nodes.get(node)
                return n is None or self.state.node_state(n, time.time()) in (
                    "exited", "unreachable")

        return self.rows.lease(call, gone)

    def run_json(self) -> dict[str, Any]:
        return self.state.run_json()

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
        """Replace `task`'s client nodes by a new revision without pausing training (swap.py).
        Blocks until done."""
        return self.swapper.swap_clients(
            task, image=image, agent=agent, grace_s=grace_s, drop_old=drop_old,
            healthy_timeout_s=healthy_timeout_s,
        )

    # -- stop conditions ----------------------------------------------------------------

    def _retire_finished_tasks(self) -> None:
        """A task that trains a model which reached `train.max_steps` (a team: any of its
        models, whose calls would go to a server that stopped) has nothing left to train:
        its client nodes drain, once, in a thread of their own, and stay down. The run goes
        on while another model trains."""
        for name, task in self.recipe.tasks.items():
            if name in self._retired_tasks:
                continue
            done = [m for m in task.models if self.state.reached_max_steps(m)]
            if not done:
                continue
            self._retired_tasks.add(name)
            with self.state.lock:
                nodes = [n for n in self.state.nodes.values()
                         if n.kind == "client" and n.task == name and n.state != "exited"]
            log.info("task %s: %s reached train.max_steps; draining its %d client node(s)",
                     name, ", ".join(done), len(nodes))
            drain = threading.Thread(
                target=self.reconciler.drain_nodes, args=(nodes, self.opts.grace_s, "client"),
                name=f"retire-{name}", daemon=True,
            )
            drain.start()
            self._threads.append(drain)

    def _finished_reason(self) -> str:
        duration = self.recipe.run.duration_s
        if duration is not None and time.time() - self.state.started_at >= duration:
            return f"duration_s ({duration:g}s) elapsed"
        if self.recipe.models and all(self.state.reached_max_steps(m) for m in self.recipe.models):
            return "every model reached train.max_steps"
        with self.state.lock:
            servers = [n for n in self.state.nodes.values() if n.kind == "server"]
            if servers and all(n.state == "exited" for n in servers):
                return "every server exited"
        return ""

    # -- drain ----------------------------------------------------------------------------

    def _teardown(self) -> None:
        with self.state.lock:
            self.state.phase = "stopping"
        self.state.write_run_json()
        grace = self._stop_grace if self._stop_grace is not None else self.opts.grace_s
        try:
            kinds: tuple[NodeKind, ...] = ("client", "server")
            for kind in kinds:
                self.reconciler.drain(kind, grace)
            self.reconciler.prune()
        finally:
            self.state.write_node_files()  # the nodes' last syncs
            self._refresh_plot(wait=True)
            with self.state.lock:
                self.state.phase = "finished"
                self.state.stop_reason = self.stop_reason
                self.state.finished_at = time.time()
            self.state.write_run_json()
            self._done.set()
            for t in self._threads:
                t.join(timeout=5)
            self.reconciler.close_probes()
            if self._grpc is not None:
                self._grpc.stop(grace=1.0)
            if self.received is not None:
                self.received.close()
            log.info("run %s finished: %s", self.recipe.run.name, self.stop_reason)

    # -- reward curve ---------------------------------------------------------------------

    def _refresh_plot(self, wait: bool) -> None:
        if self._plot_thread is not None and self._plot_thread.is_alive():
            if not wait:
                return
            self._plot_thread.join()
        signature = _curve_signature(self.paths)
        if not signature or signature == self._plot_signature:
            return
        self._plot_signature = signature
        self._plot_thread = threading.Thread(target=self._write_plot, name="plot", daemon=True)
        self._plot_thread.start()
        if wait:
            self._plot_thread.join()

    def _write_plot(self) -> None:
        from jetctl.controller.plot import write_reward_curve

        try:
            write_reward_curve(self.run_dir)
        except (OSError, ValueError) as e:
            log.error("could not write the reward curve: %s", e)


def _control_port(prior: dict[str, Any] | None) -> int:
    endpoint = str(((prior or {}).get("controller") or {}).get("endpoint") or "")
    port = endpoint.rpartition(":")[2]
    return int(port) if port.isdigit() else 0


def _describe(handles: list[NodeHandle]) -> str:
    return ", ".join(
        f"{h.spec.name} ({f'pid {h.pid}' if h.pid else f'container {h.container_id:.12}'})"
        for h in handles
    )


def _curve_signature(paths: RunPaths) -> tuple[tuple[str, float, int], ...]:
    """What the curves are made from: the step logs (reward_curve) and the servers' stores
    with their WAL (reward_by_task: a group stored after the last step changes it too)."""
    files = sorted(paths.metrics.glob("*.steps.jsonl"))
    for store in paths.stores().values():
        files += [store, store.with_name(store.name + "-wal")]
    out = []
    for p in files:
        try:
            st = p.stat()
        except OSError:
            continue
        out.append((str(p), st.st_mtime, st.st_size))
    return tuple(out)
