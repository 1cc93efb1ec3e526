"""Run state: what the controller knows of a run, held under one lock.

The reconcile loop (reconcile.py), the swaps (swap.py) and the Control service's threads all
read and change it: the desired nodes and what each is doing, the servers' last health and
`Status`, each task's current revision and the run's phase. Two views are made from it here:
the `Control.Status` reply and `run.json` (docs/CONTRACTS.md).
"""

from __future__ import annotations

import json
import os
import re
import threading
import time
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

from jetctl.controller.runtimes.base import NodeHandle, NodeKind
from jetctl.proctree import process_create_time
from jetctl.proto._gen import control_pb2 as cpb
from jetctl.recipe import Recipe
from jetctl.rundir import RunPaths, read_json, write_json_atomic
from jetctl.tls import TlsFiles

RunPhase = Literal["starting", "running", "stopping", "finished"]
# pending: not started yet (a client waits for its server) | starting: process up, not ready |
# running | restarting: died, waiting out its backoff | draining: SIGTERM sent (or, for a node
# the controller did not start, told to drain at its next sync) | exited | unreachable: a node
# the controller did not start has not synced for UNREACHABLE_S
NodeRunState = Literal[
    "pending", "starting", "running", "restarting", "draining", "exited", "unreachable"
]
# runtimes of nodes the controller does not start: a client that joined by hand
# (`jetctl client --join`), a server the user runs (`models.<m>.runtime: external`)
UNMANAGED = ("joined", "external")
UNREACHABLE_S = 15.0

FIRST_REVISION = "r0"
_REVISION = re.compile(r"^r(\d+)$")


def client_node_name(task: str, index: int, revision: str = FIRST_REVISION) -> str:
    """The node name a client writes `nodes/<name>.json` under: `<task>-<index>` for the
    first revision, `<task>-<index>-<revision>` for the ones swapped in later."""
    return f"{task}-{index}" if revision == FIRST_REVISION else f"{task}-{index}-{revision}"


def server_node_name(model: str) -> str:
    return f"server-{model}"


@dataclass(frozen=True)
class TaskRevision:
    """What a task's clients run now: the revision tag and what a swap replaced."""

    revision: str = FIRST_REVISION
    agent: str | None = None  # None: the recipe's agent
    image: str | None = None  # None: the recipe's image (runtime: docker)


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
    started_at: float = 0.0  # wall clock of the last start (or join)
    host: str = ""  # where it runs, as it reports

    @property
    def managed(self) -> bool:
        """The controller starts, restarts and signals it (else it only hears from it)."""
        return self.runtime not in UNMANAGED


@dataclass
class Report:
    """The last `Control.Sync` of a node: its own status figures and what it enforces."""

    status: dict[str, Any]
    received_at: float  # wall clock, at the controller
    kind: str = "client"  # client | server
    host: str = ""
    endpoint: str = ""  # servers: the address clients dial
    metrics: str = ""  # servers: /metrics
    refused: frozenset[str] = frozenset()  # servers: the revisions they refuse now
    final: bool = False  # it sent its last records and exits

    @property
    def state(self) -> str:
        return str(self.status.get("state", ""))


class RunState:
    """The run as the controller sees it. Hold `lock` to read or change more than one field."""

    def __init__(self, recipe: Recipe, recipe_path: Path, paths: RunPaths) -> None:
        self.recipe = recipe
        self.recipe_path = recipe_path
        self.paths = paths
        self.lock = threading.RLock()
        self.phase: RunPhase = "starting"
        self.started_at = time.time()
        self.stop_reason = ""  # why the run ended (or is ending)
        self.finished_at: float | None = None
        self.endpoint = ""  # the Control service, host:port
        self.tls: TlsFiles | None = None  # run.tls; None: plaintext
        self.nodes: dict[str, Node] = {}
        self.healthy: dict[str, bool] = {}  # model -> answered health since its last start
        self.ever_ready: set[str] = set()  # models whose server was ready once
        self.server_status: dict[str, dict[str, Any]] = {}  # model -> swarm Status as dict
        self.revisions: dict[str, TaskRevision] = {t: TaskRevision() for t in recipe.tasks}
        self.reports: dict[str, Report] = {}  # node -> its last sync
        self.refused: dict[str, frozenset[str]] = {}  # model -> revisions its server refuses
        self.retired: set[str] = set()  # nodes drained and forgotten (a swap's old ones)
        self._run_json_lock = threading.Lock()
        self._last_run_json: dict[str, Any] | None = None
        self._written: dict[str, float] = {}  # node -> received_at of the report on disk

    def adopt_prior(self, prior: dict[str, Any]) -> dict[str, int]:
        """Take over what an earlier controller left in run.json (start time, each task's
        revision); returns the servers' ports, to reuse."""
        self.started_at = float(prior.get("started_at", self.started_at))
        self.revisions.update(_revisions_from_run_json(prior, self.recipe.tasks))
        for model, entries in (prior.get("refused") or {}).items():
            if model in self.recipe.models:
                self.refused[model] = frozenset(str(e) for e in entries)
        return _ports_from_run_json(prior)

    def model_version(self, model: str) -> int:
        with self.lock:
            return int((self.server_status.get(model) or {}).get("model_version", 0))

    def trained(self, model: str) -> dict[str, Any]:
        """What the controller last heard over the network of `model`'s training: `version`
        (optimizer steps: the larger of its last `Status` and its last sync, which a server
        sends as it exits), `reward_mean_recent`, `trained_groups`, `last_checkpoint_version`.
        The end-of-run summary reads them from run.json: a server on another host (Ray,
        external) keeps its step log there. {} before the first word from it."""
        with self.lock:
            status = dict(self.server_status.get(model) or {})
            report = self.reports.get(server_node_name(model))
            synced = report.status.get("version") if report is not None else None
        out: dict[str, Any] = {}
        versions = [int(v) for v in (status.get("model_version"), synced) if v is not None]
        if versions:
            out["version"] = max(versions)
        if status:
            out["reward_mean_recent"] = float(status.get("reward_mean_recent") or 0.0)
            out["trained_groups"] = int(status.get("trained_groups") or 0)
            out["last_checkpoint_version"] = int(status.get("last_checkpoint_version") or 0)
        return out

    def reached_max_steps(self, model: str) -> bool:
        max_steps = self.recipe.models[model].train.max_steps
        return max_steps is not None and self.model_version(model) >= max_steps

    def node_state(self, node: Node, now: float) -> NodeRunState:
        """What status shows: a node the controller does not start is unreachable once its
        syncs stop."""
        report = self.reports.get(node.name)
        if node.managed or node.state not in ("starting", "running"):
            return node.state
        if report is None or now - report.received_at > UNREACHABLE_S:
            return "unreachable"
        return node.state

    def servers(self) -> dict[str, str]:
        """model -> the endpoint its server gave (or the controller assigned)."""
        with self.lock:
            return {
                n.model: n.endpoint
                for n in self.nodes.values()
                if n.kind == "server" and n.endpoint
            }

    def next_revision(self) -> str:
        """r<N+1>, N the highest revision number of the run (revisions are run-wide)."""
        numbers = [0]
        with self.lock:
            revs = [r.revision for r in self.revisions.values()]
            revs += [n.revision for n in self.nodes.values()]
        for rev in revs:
            m = _REVISION.match(rev)
            if m:
                numbers.append(int(m.group(1)))
        return f"r{max(numbers) + 1}"

    # -- views ---------------------------------------------------------------------------

    def status(self) -> cpb.RunStatusReply:
        """The `Control.Status` reply: every node with its state and its own figures."""
        now = time.time()
        with self.lock:
            rows = [
                (
                    n,
                    n.handle.pid if n.handle else n.last_pid,
                    n.handle.container_id if n.handle else None,
                    self.node_state(n, now),
                    n.restarts,
                )
                for n in self.nodes.values()
            ]
            server_json = {m: json.dumps(s, sort_keys=True) for m, s in self.server_status.items()}
            client_json = {
                name: json.dumps(r.status, sort_keys=True) for name, r in self.reports.items()
            }
            phase = self.phase
        nodes = []
        for n, pid, cid, nstate, restarts in rows:
            if n.kind == "server" and nstate == "starting":
                figures = self._starting_figures(n.model, pid)
            elif n.kind == "server":
                figures = server_json.get(n.model, "{}")
            else:
                figures = client_json.get(n.name, "{}")
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
            run_dir=str(self.paths.root),
            uptime_s=max(0.0, time.time() - self.started_at),
            nodes=nodes,
            state=phase,
        )

    def _starting_figures(self, model: str, pid: int | None) -> str:
        """A starting server's phase (what its process reports it is doing), if that file
        is from the process now running."""
        phase = read_json(self.paths.server_phase(model)) or {}
        if pid and phase.get("pid") == pid:
            return json.dumps({"phase": phase.get("phase"), "phase_since": phase.get("phase_since")})
        return "{}"

    def run_json(self) -> dict[str, Any]:
        """run.json as docs/CONTRACTS.md describes it (plus `state` and the controller's
        process start time, which guards against a recycled pid)."""
        with self.lock:
            servers = {
                n.model: {"endpoint": n.endpoint, "metrics": n.metrics, "pid": n.last_pid or None,
                          "trained": self.trained(n.model)}
                for n in self.nodes.values()
                if n.kind == "server"
            }
            clients: dict[str, dict[str, Any]] = {}
            for n in self.nodes.values():
                if n.kind != "client":
                    continue
                entry: dict[str, Any] = {"task": n.task, "revision": n.revision}
                if not n.managed:
                    entry.update(runtime=n.runtime, host=n.host)
                elif n.handle is not None and n.handle.container_id:
                    entry["container_id"] = n.handle.container_id
                else:
                    entry["pid"] = n.last_pid or None
                clients[n.name] = entry
            tasks = {
                t: {"revision": r.revision, "agent": r.agent, "image": r.image}
                for t, r in self.revisions.items()
            }
            refused = {m: sorted(r) for m, r in self.refused.items() if r}
            phase = self.phase
        return {
            "run": self.recipe.run.name,
            "recipe": str(self.recipe_path),
            "run_dir": str(self.paths.root),
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
            "refused": refused,
            "state": phase,
            "stop_reason": self.stop_reason or None,
            "finished_at": self.finished_at,
        }

    def write_run_json(self) -> None:
        """Write run.json when it changed. The reconcile loop and a swap (a Control thread)
        both call this; one at a time."""
        with self._run_json_lock:
            data = self.run_json()
            if data != self._last_run_json:
                write_json_atomic(self.paths.run_json, data)
                self._last_run_json = data


    def write_node_files(self) -> None:
        """`nodes/<name>.json`: the last status each client node synced, kept by the
        controller on its own disk (for tools, and after the run); a node writes no file."""
        with self.lock:
            fresh = [
                (name, r) for name, r in self.reports.items()
                if self._written.get(name) != r.received_at and r.kind == "client"
            ]
            for name, r in fresh:
                self._written[name] = r.received_at
        for name, r in fresh:
            write_json_atomic(self.paths.node_file(name), {**r.status, "host": r.host})


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

