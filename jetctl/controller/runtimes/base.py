"""The runtime interface: how the controller starts, watches, stops and lists nodes.

The controller only talks to `Runtime`; `process` (subprocesses on this host), `docker`
(one container per client node, `docker.py`) and `ray` (one actor per node on a Ray
cluster, `ray.py`) implement it. A node is described by a `NodeSpec` (plus a
`ContainerSpec` for docker, a `Placement` for ray) and known afterwards by a `NodeHandle`,
which carries what a later controller needs to adopt it again (`list`).
"""

from __future__ import annotations

import builtins
import time
from abc import ABC, abstractmethod
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Literal

NodeKind = Literal["server", "client"]


class RuntimeUnavailable(Exception):
    """The runtime's engine cannot be used here (no dockerd, no Ray cluster, a missing
    image); the message says what to do."""


@dataclass(frozen=True)
class Mount:
    """A host path bind-mounted into a node's container at `target` (default: the same path)."""

    source: Path
    read_only: bool = True
    target: Path | None = None
    # a secret of the node's (its TLS key): a copy owned by the container's user, mode
    # 0600, in the node's own folder, is mounted (read-only) instead of the host's file
    private: bool = False

    @property
    def at(self) -> Path:
        return self.target if self.target is not None else self.source


@dataclass(frozen=True)
class ContainerSpec:
    """How the docker runtime runs a node: image, limits, network and what it may see.

    A client container sees only what the node owns (runtimes/docker.py): its spool folder,
    its log, `mounts` (read-only unless said), never the run dir.
    """

    image: str
    cpus: float | None = None
    memory: str | None = None  # docker byte size: 512m, 2g (None: the runtime's default)
    pids: int | None = None  # None: the runtime's default
    shm: str | None = None
    tmp: str | None = None  # size of the /tmp tmpfs, the only scratch (None: the default)
    mounts: tuple[Mount, ...] = ()
    spool: Path | None = None  # host folder the node sees as `<run dir>/spool` (its own)
    docker_socket: bool = False  # the engine's socket at /var/run/docker.sock (and its group)
    network: Literal["isolated", "host"] = "isolated"
    reach: tuple[int, ...] = ()  # ports of this host it dials (controller, servers): open


@dataclass(frozen=True)
class Placement:
    """Where the ray runtime places a node: bundle `index` of the placement group `group`
    (`bundles` bundles of `resources` each, spread over the cluster's nodes)."""

    group: str  # <task>/<revision> | server/<model>
    bundles: int
    index: int
    resources: tuple[tuple[str, float], ...]  # Ray resource name -> amount, per bundle
    work_dir: str  # on the node's host: its own run dir (spool, logs)


@dataclass(frozen=True)
class NodeSpec:
    """What to run for one node: a server (one per model) or a client node (N per task)."""

    name: str  # server-<model> | <task>-<index>[-<revision>]; unique in a run, a file name
    kind: NodeKind
    argv: list[str]
    log_path: Path
    model: str = ""
    task: str = ""
    index: int = 0
    revision: str = "r0"
    env: dict[str, str] = field(default_factory=dict)  # added to the controller's environment
    cwd: Path | None = None
    labels: dict[str, str] = field(default_factory=dict)
    container: ContainerSpec | None = None  # runtime: docker only
    placement: Placement | None = None  # runtime: ray only


@dataclass
class NodeHandle:
    """A started (or adopted) node. `pid` for processes, `container_id` for containers."""

    spec: NodeSpec
    pid: int | None = None
    container_id: str | None = None
    started_at: float = field(default_factory=time.time)
    adopted: bool = False  # found by `list`, not started by this runtime object
    runtime: str = ""  # the runtime that runs it ('' : process, or docker by container_id)


@dataclass(frozen=True)
class NodeState:
    """What `poll` saw: running, or exited with a code (None when the code is unknowable,
    e.g. an adopted process that is not our child)."""

    running: bool
    exit_code: int | None = None


class Runtime(ABC):
    """Starts, watches, stops and lists the nodes of one run."""

    name: str = "runtime"

    @abstractmethod
    def start(self, spec: NodeSpec) -> NodeHandle:
        """Start the node and record it so that `list` finds it again."""

    @abstractmethod
    def poll(self, handle: NodeHandle) -> NodeState:
        """Whether the node still runs; never blocks."""

    @abstractmethod
    def terminate(self, handle: NodeHandle) -> None:
        """Ask the node to drain and exit (SIGTERM); returns at once."""

    @abstractmethod
    def kill(self, handle: NodeHandle) -> None:
        """End the node and everything it started now (SIGKILL)."""

    @abstractmethod
    def list(self, run: str) -> builtins.list[NodeHandle]:
        """The run's recorded nodes that are still running, to adopt after a controller restart."""

    @abstractmethod
    def release(self, handle: NodeHandle) -> None:
        """Forget an exited node (its pid file, its stopped container)."""

    def prune(self, run: str) -> int:
        """Remove what exited nodes of the run left behind (stopped containers); returns
        how many. Running nodes are left to `list` (adopt) and `stop_all`."""
        return 0

    def release_group(self, group: str) -> None:
        """Free what the engine holds for a placement group whose nodes all exited (a task
        revision a swap drained); nothing to do where there are no groups."""

    def close(self) -> None:
        """Release connections to the engine, if any."""

    def stop(self, handle: NodeHandle, grace_s: float) -> NodeState:
        """SIGTERM, wait up to `grace_s`, then SIGKILL."""
        return self.stop_all([handle], grace_s)[0]

    def stop_all(
        self, handles: Sequence[NodeHandle], grace_s: float
    ) -> builtins.list[NodeState]:
        """Drain several nodes at once: SIGTERM to all, one shared grace, SIGKILL the rest."""
        for h in handles:
            if self.poll(h).running:
                self.terminate(h)
        deadline = time.monotonic() + max(grace_s, 0.0)
        states = [self.poll(h) for h in handles]
        while any(s.running for s in states) and time.monotonic() < deadline:
            time.sleep(0.1)
            states = [self.poll(h) for h in handles]
        for i, h in enumerate(handles):
            if states[i].running:
                self.kill(h)
                states[i] = self._wait_gone(h)
        return states

    def _wait_gone(self, handle: NodeHandle, timeout_s: float = 5.0) -> NodeState:
        deadline = time.monotonic() + timeout_s
        state = self.poll(handle)
        while state.running and time.monotonic() < deadline:
            time.sleep(0.05)
            state = self.poll(handle)
        return state
