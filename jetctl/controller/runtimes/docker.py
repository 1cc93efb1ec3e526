"""The `docker` runtime: one container per client node, through the `docker` SDK.

    rt = DockerRuntime(run_dir)          # raises RuntimeUnavailable when dockerd is not there
    gateway = rt.network().gateway       # the run's network; servers listen here too
    handle = rt.start(spec)              # spec.container names the image and the limits

A client container runs code the server must not trust (the agent, the env, a page Chromium
renders), so it sees and reaches only what its node needs. Each container:
* is labelled `jetctl.run`, `jetctl.task`, `jetctl.revision` (from the controller), plus
  `jetctl.run_dir`, `jetctl.node`, `jetctl.kind`, `jetctl.index`, `jetctl.model`, so a new
  controller (`up --resume`) adopts it and `up`/`down` find every container of the run
  by label: two runs of the same name in different dirs never see each other's;
* mounts only what its node owns: its spool folder (`<run>/containers/<node>/spool`, seen at
  `<run>/spool`, read-write) and its log file (`<run>/logs/<node>.log`, appended by the
  wrapper), plus `spec.container.mounts` (read-only: the TLS files a client presents, never
  a key of the server or the CA). Never run.json, the run token, the TLS directory, a
  server's store or checkpoints, another node's spool;
* authenticates with its node's credential (`JETCTL_TOKEN` in its environment, jetctl.auth),
  which allows client calls only, never the run token;
* is on the run's own network (`network: isolated`, the default): an internal docker bridge
  (no route out, no traffic between containers) whose gateway address is this host's. The
  controller and this host's servers also listen on that address (the least exposure that
  works: only this host and the run's containers reach it). As root, the runtime also
  firewalls the bridge (an iptables chain on INPUT): of this host's ports only `reach`
  (controller, servers) answer, so a service of the host bound to 0.0.0.0 is not reached.
  Without root it logs that it cannot. `network: host` (the recipe's choice, logged as a
  warning) puts the node on the host's network instead;
* drops every capability (`cap_drop=ALL`), sets `no-new-privileges`, runs as a user that is
  not root (the caller's uid; nobody, 65534, when the controller runs as root), on a
  read-only root filesystem whose only scratch is a /tmp tmpfs (`tmp`, also HOME), with
  `init=True` (tini reaps the rollouts' children and forwards SIGTERM, which drains the node);
* is limited to `cpus` (nano_cpus), `memory` (mem_limit, no extra swap; default 4g) and
  `pids` (pids_limit, default 512: a fork bomb stops there), with `/dev/shm` of `shm`;
* with `docker_socket` (recipe: `docker_socket: true`) gets the engine's unix socket at
  /var/run/docker.sock and its group, so its env can start sibling containers (the code
  env's sandbox); that is control of the host's engine, so it is off by default.

Restarts are the controller's (its backoff); docker's own restart policy stays off, and
an exited container is removed (`release`), so nothing is left behind. `close` removes the
run's network (and its firewall chain) once no container is on it. Left out: servers in
containers (they need the host's accelerators; they run as processes), registries (images
are local tags, see `jetctl images build`), IPv6 on the run's network, and servers on other
hosts for an isolated task (use `network: host`).
"""

from __future__ import annotations

import builtins
import hashlib
import logging
import os
import re
import subprocess
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from jetctl import auth
from jetctl.controller.runtimes.base import (
    ContainerSpec,
    Mount,
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

log = logging.getLogger("jetctl.controller")

LABEL_RUN_DIR = "jetctl.run_dir"
LABEL_NODE = "jetctl.node"
DEFAULT_MEMORY = "4g"
DEFAULT_PIDS = 512
DEFAULT_TMP = "256m"
NOBODY = (65534, 65534)  # the user of a container whose controller runs as root
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


@dataclass(frozen=True)
class RunNetwork:
    """The run's docker network: its name, its gateway (this host's address on it) and the
    host's bridge interface."""

    name: str
    gateway: str
    bridge: str


def network_name(run_dir: Path) -> str:
    digest = hashlib.sha1(str(run_dir).encode()).hexdigest()[:6]
    return re.sub(r"[^A-Za-z0-9_.-]", "_", f"jetctl-{run_dir.name}-{digest}")


def _chain(bridge: str) -> str:
    return f"JETCTL-{bridge}"[:28]  # iptables' limit on a chain's name


def _iptables(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        ["iptables", "-w", *args], check=False, capture_output=True, text=True, timeout=30
    )


def firewall(net: RunNetwork, ports: builtins.list[int]) -> str:
    """Let the run's containers reach only `ports` of this host (and answers to what they
    opened): a chain of the bridge's on INPUT, rewritten whole. '' when done, else why not."""
    chain = _chain(net.bridge)
    rules = [["-m", "conntrack", "--ctstate", "ESTABLISHED,RELATED", "-j", "ACCEPT"]]
    rules += [["-p", "tcp", "--dport", str(p), "-j", "ACCEPT"] for p in sorted(set(ports))]
    rules += [["-j", "DROP"]]
    try:
        _iptables("-N", chain)  # fails when it exists: then it is rewritten
        steps = [("-F", chain)] + [("-A", chain, *r) for r in rules]
        for step in steps:
            done = _iptables(*step)
            if done.returncode != 0:
                return done.stderr.strip() or f"iptables {' '.join(step)} failed"
        if _iptables("-C", "INPUT", "-i", net.bridge, "-j", chain).returncode != 0:
            done = _iptables("-I", "INPUT", "1", "-i", net.bridge, "-j", chain)
            if done.returncode != 0:
                return done.stderr.strip()
    except (OSError, subprocess.SubprocessError) as e:
        return str(e)
    return ""


def remove_firewall(net: RunNetwork) -> None:
    chain = _chain(net.bridge)
    try:
        while _iptables("-D", "INPUT", "-i", net.bridge, "-j", chain).returncode == 0:
            pass
        _iptables("-F", chain)
        _iptables("-X", chain)
    except (OSError, subprocess.SubprocessError) as e:
        log.warning("could not remove the firewall chain %s: %s", chain, e)


class DockerRuntime(Runtime):
    """Client nodes as containers of the local docker engine, found by the run dir label."""

    name = "docker"

    def __init__(
        self, run_dir: Path, client: DockerClient | None = None,
        extra_mounts: tuple[Mount, ...] = (), extra_env: dict[str, str] | None = None,
    ) -> None:
        """`extra_mounts` and `extra_env`: given to every container of the run (tests' fake
        nodes, an agent under development on PYTHONPATH); mounts read-only unless said."""
        self.run_dir = Path(run_dir).resolve()
        self.paths = RunPaths(self.run_dir)
        self.client = client if client is not None else docker_client()
        self.extra_mounts = extra_mounts
        self.extra_env = dict(extra_env or {})
        self._lock = (
            threading.Lock()
        )  # the SDK's HTTP session is shared by the controller's threads
        self._containers: dict[str, Container] = {}
        self._network: RunNetwork | None = None
        self._open_ports: set[int] = set()
        self._firewall_failed = ""

    def network(self) -> RunNetwork:
        """The run's network, made on first use (kept across controllers: `up --resume`
        finds the containers on it)."""
        import docker

        if self._network is not None:
            return self._network
        name = network_name(self.run_dir)
        with self._lock:
            try:
                net = self.client.networks.get(name)
            except docker.errors.NotFound:
                net = self.client.networks.create(
                    name, driver="bridge", internal=True, check_duplicate=True,
                    labels={LABEL_RUN_DIR: str(self.run_dir)},
                    options={"com.docker.network.bridge.enable_icc": "false"},
                )
            net.reload()
        config = net.attrs["IPAM"]["Config"][0]
        bridge = net.attrs.get("Options", {}).get("com.docker.network.bridge.name") or (
            f"br-{net.id[:12]}"
        )
        self._network = RunNetwork(name=name, gateway=config["Gateway"], bridge=bridge)
        return self._network

    def _allow(self, ports: tuple[int, ...]) -> None:
        """Open `ports` of this host to the run's network, and nothing else of it."""
        if not ports or set(ports) <= self._open_ports:
            return
        self._open_ports |= set(ports)
        why = firewall(self.network(), sorted(self._open_ports))
        if why and why != self._firewall_failed:
            log.warning(
                "cannot firewall the run's docker network (%s; it needs root): a service of "
                "this host listening on 0.0.0.0 is reachable from the client containers at %s",
                why, self.network().gateway,
            )
        self._firewall_failed = why

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
        name = container_name(self.run_dir, spec.name)
        kwargs = self._run_kwargs(spec, c)
        kwargs["name"] = name
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

    def _run_kwargs(self, spec: NodeSpec, c: ContainerSpec) -> dict[str, Any]:
        """`containers.run` arguments: the node's own files, its limits, its network."""
        uid, gid = (os.getuid(), os.getgid()) if os.getuid() != 0 else NOBODY
        volumes = self._volumes(spec, c, uid, gid)
        env = {
            "PYTHONUNBUFFERED": "1",
            "PYTHONDONTWRITEBYTECODE": "1",  # the root filesystem is read-only
            "HOME": "/tmp",  # the tmpfs: the only place to write besides the spool
            "JETCTL_LOG": str(spec.log_path),
            **self.extra_env,
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
        memory = c.memory or DEFAULT_MEMORY
        kwargs: dict[str, Any] = {
            "command": ["sh", "-c", _LOG_WRAPPER, "jetctl-node", *spec.argv],
            "entrypoint": [],
            "environment": env,
            "labels": labels,
            "volumes": volumes,
            "init": True,
            "user": f"{uid}:{gid}",
            "detach": True,
            "cap_drop": ["ALL"],
            "security_opt": ["no-new-privileges"],
            "read_only": True,
            "tmpfs": {"/tmp": f"rw,nosuid,nodev,size={c.tmp or DEFAULT_TMP},mode=1777"},
            "mem_limit": memory,
            "memswap_limit": memory,  # no swap beyond the cap
            "pids_limit": c.pids or DEFAULT_PIDS,
        }
        if c.network == "host":
            log.warning("%s runs on the host's network (network: host): it reaches every "
                        "address this host does", spec.name)
            kwargs["network_mode"] = "host"
        else:
            kwargs["network"] = self.network().name
            self._allow(c.reach)
        if spec.cwd is not None:
            kwargs["working_dir"] = str(spec.cwd)
        if c.cpus is not None:
            kwargs["nano_cpus"] = int(c.cpus * 1e9)
        if c.shm is not None:
            kwargs["shm_size"] = c.shm
        if c.docker_socket:
            sock = engine_socket()
            volumes[str(sock)] = {"bind": "/var/run/docker.sock", "mode": "rw"}
            kwargs["group_add"] = [str(sock.stat().st_gid)]
        return kwargs

    def _volumes(
        self, spec: NodeSpec, c: ContainerSpec, uid: int, gid: int
    ) -> dict[str, dict[str, str]]:
        """The node's spool folder, log file and JSON log (made here, owned by the container's
        user), and the read-only mounts it asks for."""
        spool = c.spool or self.paths.container_spool(spec.name)
        spool.mkdir(parents=True, exist_ok=True)
        spec.log_path.parent.mkdir(parents=True, exist_ok=True)
        with open(spec.log_path, "ab") as log_file:
            log_file.write(
                f"\n--- jetctl: starting {spec.name} in {c.image}: {' '.join(spec.argv)}\n".encode()
            )
        json_log = self.paths.json_log(spec.name)  # jetctl.logs: its structured lines
        json_log.touch(exist_ok=True)
        for path in (spool, spool.parent, spec.log_path, json_log):
            os.chown(path, uid, gid)
        volumes = {
            str(spool): {"bind": str(self.paths.spool_dir), "mode": "rw"},
            str(spec.log_path): {"bind": str(spec.log_path), "mode": "rw"},
            str(json_log): {"bind": str(json_log), "mode": "rw"},
        }
        for m in (*c.mounts, *self.extra_mounts):
            source = self._private_copy(spec.name, m.source, uid, gid) if m.private else m.source
            volumes[str(source)] = {"bind": str(m.at), "mode": "ro" if m.read_only else "rw"}
        return volumes

    def _private_copy(self, node: str, source: Path, uid: int, gid: int) -> Path:
        """`source` copied to `<run>/containers/<node>/secrets/` (never mounted whole), 0600
        and owned by the container's user, who may not be the host file's owner."""
        copy = self.paths.containers / node / "secrets" / source.name
        copy.parent.mkdir(parents=True, exist_ok=True)
        os.chmod(copy.parent, 0o700)
        auth.write_private(copy, source.read_bytes())
        os.chown(copy, uid, gid)
        os.chown(copy.parent, uid, gid)
        return copy

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
        self.remove_network()
        return count

    def close(self) -> None:
        self.remove_network()
        self.client.close()

    def remove_network(self) -> None:
        """Remove the run's network and its firewall once no container is on it (a run that
        stops leaves none; a controller that dies leaves them to `up --resume`)."""
        import docker

        name = network_name(self.run_dir)
        try:
            with self._lock:
                net = self.client.networks.get(name)
                net.reload()
                if net.attrs.get("Containers"):
                    return
                bridge = net.attrs.get("Options", {}).get("com.docker.network.bridge.name")
                gone = RunNetwork(name, "", bridge or f"br-{net.id[:12]}")
                net.remove()
        except docker.errors.NotFound:
            return
        except docker.errors.APIError as e:
            log.warning("could not remove the network %s: %s", name, e)
            return
        remove_firewall(gone)
        self._network, self._open_ports, self._firewall_failed = None, set(), ""

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
        own = {str(self.paths.spool_dir), env.get("JETCTL_LOG", "")}
        mounts = tuple(
            Mount(Path(m["Source"]), not m.get("RW", True), Path(m["Destination"]))
            for m in container.attrs.get("Mounts") or []
            if m.get("Source") and m.get("Destination") not in own
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
                network="host" if host.get("NetworkMode") == "host" else "isolated",
            ),
        )
