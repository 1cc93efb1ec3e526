"""The `docker` runtime: one container per client node, through the `docker` SDK.

    rt = DockerRuntime(run_dir)          # raises RuntimeUnavailable when dockerd is not there
    handle = rt.start(spec)              # spec.container names the image and the limits

Each container:
* is labelled `jetctl.run`, `jetctl.task`, `jetctl.revision` (from the controller), plus
  `jetctl.run_dir`, `jetctl.node`, `jetctl.kind`, `jetctl.index`, `jetctl.model`, so a new
  controller (`up --resume`) adopts it and `up`/`down` find every container of the run
  by label: two runs of the same name in different dirs never see each other's;
* runs on the host network (`network_mode="host"`): the servers on 127.0.0.1 are reached
  as from a process, and the node's /metrics port is a host port;
* gets the run dir bind-mounted at the same path (read-write) and the recipe (read-only),
  so the token, `servers/<model>.json`, `nodes/<node>.json` and the spool work unchanged;
* runs as the calling user (files in the run dir stay the user's), with `init=True`
  (tini reaps the rollouts' children and forwards SIGTERM, which drains the node);
* is limited to `cpus` (nano_cpus), `memory` (mem_limit, no extra swap) and `pids`
  (pids_limit), with `/dev/shm` of `shm` (Chromium needs more than docker's 64m);
* with `docker_socket` (recipe: `docker_socket: true`) gets the engine's unix socket at
  /var/run/docker.sock and its group, so its env can start sibling containers (the code
  env's sandbox); that is control of the host's engine, so it is off by default;
* appends its stdout+stderr to `<run_dir>/logs/<node>.log`, like a process node.

Restarts are the controller's (its backoff); docker's own restart policy stays off, and
an exited container is removed (`release`), so nothing is left behind. Left out: servers
in containers (they need the host's accelerators; they run as processes), registries
(images are local tags, see `jetctl images build`).
"""

from __future__ import annotations

import builtins
import hashlib
import os
import re
import threading
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any

from jetctl.controller.runtimes.base import (
    ContainerSpec,
    NodeHandle,
    NodeSpec,
    NodeState,
    Runtime,
    RuntimeUnavailable,
)
from jetctl.rundir import RunPaths

if TYPE_CHECKING:
    from docker import DockerClient
    from docker.models.containers import Container

LABEL_RUN_DIR = "jetctl.run_dir"
LABEL_NODE = "jetctl.node"
# sh is in every base image; `exec` keeps the node as tini's only child
_LOG_WRAPPER = 'exec "$@" >>"$JETCTL_LOG" 2>&1'
_LIVE = ("created", "running", "restarting", "paused")


def docker_client(timeout_s: float = 30.0) -> DockerClient:
    """A client of the local engine (DOCKER_HOST or the default socket), pinged once."""
    try:
        import docker
    except ImportError:
        raise RuntimeUnavailable(
            "runtime: docker needs the docker SDK: pip install 'jetctl[docker]' "
            "(scripts/setup.sh installs it)"
        ) from None
    try:
        client = docker.from_env(timeout=int(timeout_s))
        client.ping()
    except docker.errors.DockerException as e:
        raise RuntimeUnavailable(
            f"cannot reach the docker engine ({e}): start it (`scripts/ci-services.sh docker` "
            "or `dockerd &`) or point DOCKER_HOST at it"
        ) from None
    return client


def engine_socket() -> Path:
    """The engine's unix socket on this host (DOCKER_HOST or the default)."""
    host = os.environ.get("DOCKER_HOST", "unix:///var/run/docker.sock")
    if not host.startswith("unix://"):
        raise OSError(f"docker_socket needs the engine on a unix socket; DOCKER_HOST is {host!r}")
    path = Path(host.removeprefix("unix://"))
    if not path.exists():
        raise OSError(f"docker_socket: {path} does not exist (is dockerd running?)")
    return path


def container_name(run_dir: Path, node: str) -> str:
    """`jetctl-<run dir name>-<node>-<6 hex of the run dir path>`: readable in `docker ps`,
    unique per run dir."""
    digest = hashlib.sha1(str(run_dir).encode()).hexdigest()[:6]
    raw = f"jetctl-{run_dir.name}-{node}-{digest}"
    return re.sub(r"[^A-Za-z0-9_.-]", "_", raw)


class DockerRuntime(Runtime):
    """Client nodes as containers of the local docker engine, found by the run dir label."""

    name = "docker"

    def __init__(self, run_dir: Path, client: DockerClient | None = None) -> None:
        self.run_dir = Path(run_dir).resolve()
        self.client = client if client is not None else docker_client()
        self._lock = (
            threading.Lock()
        )  # the SDK's HTTP session is shared by the controller's threads
        self._containers: dict[str, Container] = {}

    # -- the interface ------------------------------------------------------------------

    def check_image(self, image: str) -> None:
        """Raise RuntimeUnavailable unless `image` is in the local engine."""
        import docker

        try:
            with self._lock:
                self.client.images.get(image)
        except docker.errors.ImageNotFound:
            raise RuntimeUnavailable(
                f"docker image {image!r} is not built: run `jetctl images build` "
                "(add --offline-base where no registry is reachable)"
            ) from None

    def start(self, spec: NodeSpec) -> NodeHandle:
        import docker

        if spec.container is None:
            raise ValueError(f"{spec.name}: the docker runtime needs spec.container (an image)")
        c = spec.container
        spec.log_path.parent.mkdir(parents=True, exist_ok=True)
        with open(spec.log_path, "ab") as log:
            log.write(
                f"\n--- jetctl: starting {spec.name} in {c.image}: {' '.join(spec.argv)}\n".encode()
            )
        name = container_name(self.run_dir, spec.name)
        volumes = {str(self.run_dir): {"bind": str(self.run_dir), "mode": "rw"}}
        for path, read_only in c.mounts:
            volumes[str(path)] = {"bind": str(path), "mode": "ro" if read_only else "rw"}
        env = {
            "PYTHONUNBUFFERED": "1",
            "HOME": "/tmp",  # the caller's uid has no home in the image
            "JETCTL_LOG": str(spec.log_path),
            **spec.env,
        }
        labels = {
            **spec.labels,
            LABEL_RUN_DIR: str(self.run_dir),
            LABEL_NODE: spec.name,
            "jetctl.kind": spec.kind,
            "jetctl.index": str(spec.index),
            "jetctl.model": spec.model,
            "jetctl.task": spec.task,
            "jetctl.revision": spec.revision,
        }
        kwargs: dict[str, Any] = {
            "name": name,
            "command": ["sh", "-c", _LOG_WRAPPER, "jetctl-node", *spec.argv],
            "entrypoint": [],
            "environment": env,
            "labels": labels,
            "volumes": volumes,
            "network_mode": "host",
            "init": True,
            "user": f"{os.getuid()}:{os.getgid()}",
            "detach": True,
        }
        if spec.cwd is not None:
            kwargs["working_dir"] = str(spec.cwd)
        if c.cpus is not None:
            kwargs["nano_cpus"] = int(c.cpus * 1e9)
        if c.memory is not None:
            kwargs["mem_limit"] = c.memory
            kwargs["memswap_limit"] = c.memory  # no swap beyond the cap
        if c.pids is not None:
            kwargs["pids_limit"] = c.pids
        if c.shm is not None:
            kwargs["shm_size"] = c.shm
        if c.docker_socket:
            sock = engine_socket()
            volumes[str(sock)] = {"bind": "/var/run/docker.sock", "mode": "rw"}
            kwargs["group_add"] = [str(sock.stat().st_gid)]  # the node runs as the caller's uid
        try:
            with self._lock:
                self._remove_by_name(name)
                container = self.client.containers.run(c.image, **kwargs)
        except docker.errors.ImageNotFound as e:
            raise OSError(f"image {c.image!r} not found: run `jetctl images build` ({e})") from None
        except docker.errors.APIError as e:
            raise OSError(f"docker could not start {spec.name}: {e}") from None
        self._containers[container.id] = container
        return NodeHandle(spec=spec, container_id=container.id, started_at=time.time())

    def poll(self, handle: NodeHandle) -> NodeState:
        import docker

        container = self._container(handle)
        if container is None:
            return NodeState(running=False)
        try:
            with self._lock:
                container.reload()
        except docker.errors.NotFound:
            self._containers.pop(container.id, None)
            return NodeState(running=False)
        except docker.errors.APIError:
            return NodeState(running=True)  # the engine hiccuped; ask again next tick
        if container.status in _LIVE:
            return NodeState(running=True)
        return NodeState(running=False, exit_code=int(container.attrs["State"]["ExitCode"]))

    def terminate(self, handle: NodeHandle) -> None:
        self._signal(handle, "SIGTERM")

    def kill(self, handle: NodeHandle) -> None:
        import docker

        self._signal(handle, "SIGKILL")
        container = self._container(handle)
        if container is None:
            return
        try:
            container.wait(timeout=5)
        except (docker.errors.APIError, OSError):
            pass  # gone already, or still stopping; poll tells

    def list(self, run: str = "") -> builtins.list[NodeHandle]:
        """Running containers of this run dir (and of run `run`, when given)."""
        handles: builtins.list[NodeHandle] = []
        for container in self._find(running_only=True, run=run):
            spec = self._spec_from(container)
            self._containers[container.id] = container
            handles.append(
                NodeHandle(
                    spec=spec, container_id=container.id, started_at=time.time(), adopted=True
                )
            )
        return handles

    def release(self, handle: NodeHandle) -> None:
        import docker

        container = self._container(handle)
        if container is None:
            return
        try:
            with self._lock:
                container.remove(force=True)
        except docker.errors.NotFound:
            pass
        except docker.errors.APIError as e:
            if "already in progress" not in str(e):
                raise
        self._containers.pop(container.id, None)

    def prune(self, run: str = "") -> int:
        import docker

        stopped = self._find(running_only=False, run=run)
        count = 0
        for container in stopped:
            if container.status in _LIVE:
                continue
            try:
                with self._lock:
                    container.remove(force=True)
                count += 1
            except docker.errors.NotFound:
                pass
        return count

    def close(self) -> None:
        self.client.close()

    # -- helpers ------------------------------------------------------------------------

    def _find(self, running_only: bool, run: str) -> builtins.list[Container]:
        filters = [f"{LABEL_RUN_DIR}={self.run_dir}"]
        if run:
            filters.append(f"jetctl.run={run}")
        with self._lock:
            found: builtins.list[Container] = self.client.containers.list(
                all=not running_only, filters={"label": filters}
            )
        return found

    def _container(self, handle: NodeHandle) -> Container | None:
        import docker

        cid = handle.container_id
        if not cid:
            return None
        container = self._containers.get(cid)
        if container is None:
            try:
                with self._lock:
                    container = self.client.containers.get(cid)
            except docker.errors.NotFound:
                return None
            self._containers[cid] = container
        return container

    def _signal(self, handle: NodeHandle, sig: str) -> None:
        import docker

        container = self._container(handle)
        if container is None:
            return
        try:
            with self._lock:
                container.kill(signal=sig)
        except docker.errors.APIError:
            pass  # not running (409) or gone (404): nothing to signal

    def _remove_by_name(self, name: str) -> None:
        import docker

        try:
            self.client.containers.get(name).remove(force=True)
        except docker.errors.NotFound:
            pass

    def _spec_from(self, container: Container) -> NodeSpec:
        labels: dict[str, str] = dict(container.labels)
        cmd = builtins.list(container.attrs["Config"].get("Cmd") or [])
        argv = cmd[4:] if cmd[:2] == ["sh", "-c"] else cmd  # sh -c WRAPPER $0 argv...
        env = dict(e.split("=", 1) for e in container.attrs["Config"].get("Env") or [] if "=" in e)
        host = container.attrs["HostConfig"]
        mounts = tuple(
            (Path(m["Source"]), not m.get("RW", True))
            for m in container.attrs.get("Mounts") or []
            if m.get("Source") and Path(m["Source"]) != self.run_dir
        )
        return NodeSpec(
            name=labels.get(LABEL_NODE, container.name),
            kind="server" if labels.get("jetctl.kind") == "server" else "client",
            argv=argv,
            log_path=Path(
                env.get("JETCTL_LOG", str(RunPaths(self.run_dir).log(container.name)))
            ),
            model=labels.get("jetctl.model", ""),
            task=labels.get("jetctl.task", ""),
            index=int(labels.get("jetctl.index", "0") or 0),
            revision=labels.get("jetctl.revision", "r0"),
            labels={k: v for k, v in labels.items() if k.startswith("jetctl.")},
            container=ContainerSpec(
                image=str(container.attrs["Config"].get("Image", "")),
                cpus=(host.get("NanoCpus") or 0) / 1e9 or None,
                pids=host.get("PidsLimit") or None,
                mounts=mounts,
            ),
        )
