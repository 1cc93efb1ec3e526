"""The ray runtime: one Ray actor per node on the cluster at `run.ray.address`.

    pip install 'jetctl[ray]'        # every host of the cluster needs jetctl importable

Ray places, jetctl does not schedule: each task revision's client nodes get one placement
group (`<task>/<revision>`, a bundle per node of `tasks.<t>.resources`: cpus, gpus, memory
and custom resources, strategy SPREAD) and each server its own (`server/<model>`, `models.
<m>.resources`); node `i` is an actor in bundle `i`. The actor (`NodeProcess`) runs the same
`jetctl client` / `jetctl server` command the process runtime runs, as a subprocess on its
Ray host, in the run's work dir there (`run.ray.work_dir/<namespace>`: the node's spool and
log), with the controller's address, the token and the TLS files in its environment. The
TLS files travel as PEM text and are written, each node's in a directory of its own, under
the run's private directory there (`private/<node>/`: directories 0700, files 0600, made
with O_EXCL | O_NOFOLLOW; one owned by another user, a symlink or with looser modes is
refused). So the node joins the controller over the network like any other.

The secrets (the node's whole environment: the token or credential, the PEM text) are not
the actor's creation arguments. Ray keeps an actor's creation task, arguments included,
in its GCS for the actor's life (to restart it), where whoever can reach the cluster may
read them: those arguments are the spec only (`_spec_json`: name, command line, labels,
placement, paths). The environment comes in one actor call, `start(env)`, made right
after the creation; the actor starts the node then, and keeps none of it (only the node's
process has it). Ray runs that call without retries (`max_task_retries=0`), and the
caller's Ray worker (the controller's) keeps a finished task's spec, arguments included,
only while the task could be re-executed (retries left and a result in the object store:
`TaskManager::CompletePendingTask`), so once `start` ran Ray holds it nowhere; Ray's task
events (the state API, the dashboard) record no arguments. An actor Ray restarted would
come up with its spec only and run nothing, and Ray restarts none (`max_restarts=0`).
Still held, as before: the node's environment in its process (`/proc/<pid>/environ`, for
the host's root and that user), the keys in its private directory, and the call in the
controller's memory until the actor is placed and has run it; and the call crosses the
network in Ray's own RPC, encrypted only where the cluster runs Ray with TLS. An actor's
`info` (what `list` and `prune` read) never carries the environment either.
`run.ray.runtime_env` is no place for a secret: Ray records it with every actor and task.

Actors are named after their node and detached, in the namespace `run.ray.namespace`
(default `jetctl-<run>`): a controller that died leaves them running and `jetctl up --resume`
finds them (`list`); `jetctl down` and the end of the run remove them and the placement
groups, a swap the drained revision's group (`release_group`). Restarts are the
controller's (with its backoff), not Ray's: `max_restarts=0`. `up --resume`
adopts live actors as they are (their nodes run already): nothing is re-sent.

Left out: Ray's own logs (the node's log stays on its host, `logs/<node>.log` under the work
dir), autoscaling; and per-node credentials for Ray hosts (each gets the run's TLS files).
"""

from __future__ import annotations

import builtins
import json
import logging
import os
import signal
import socket
import stat
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import TYPE_CHECKING, Any

from jetctl.controller.runtimes.base import (
    NodeHandle,
    NodeSpec,
    NodeState,
    Placement,
    Runtime,
    RuntimeUnavailable,
)
from jetctl.net import route_address

if TYPE_CHECKING:
    from jetctl.recipe import RayConfig

log = logging.getLogger("jetctl.controller")

PYTHON = "python"  # argv[0] of a node command: the Ray worker's own interpreter
TLS_PEMS_ENV = "JETCTL_TLS_PEMS"  # {file name: PEM text}, written under PRIVATE_DIR
PRIVATE_DIR = "private"  # in the run's work dir on a Ray host: 0700, a directory per node
CALL_TIMEOUT_S = 10.0
POLL_TIMEOUT_S = 2.0  # a poll runs in the reconcile loop: an actor not placed yet is "running"


class NodeProcess:
    """The actor: runs one node's command as a subprocess on its Ray host (see module doc).

    A session of its own (the rollouts of a client node are process groups inside it, so
    `kill` reaches them), and the kernel kills it if the actor's process dies."""

    def __init__(self, spec: dict[str, Any]) -> None:
        """`spec` holds no secret (`_spec_json`): Ray keeps it for the actor's life. The node
        starts in `start`, when the secrets come; an actor Ray restarted (it should not:
        `max_restarts=0`) comes up without them and runs nothing."""
        self.spec = spec
        self.proc: subprocess.Popen[bytes] | None = None
        self.started_at = 0.0
        self.error = ""  # why `start` failed: the node will not run

    def start(self, env: dict[str, str]) -> None:
        """Start the node with `env`, its environment (the token, the TLS PEM text), once.
        Delivered by this one call, not kept on the actor: only the node's process has it.
        An error here (a refused private dir) is kept: `poll` then says the node exited."""
        if self.started_at:
            raise RuntimeError(f"{self.spec['name']}: the node was started already")
        self.started_at = time.time()  # set first: a failed start is an exited node to prune
        try:
            self._start(env)
        except BaseException as e:
            self.error = f"{type(e).__name__}: {e}"
            raise

    def _start(self, secrets: dict[str, str]) -> None:
        work = Path(self.spec["work_dir"])
        (work / "logs").mkdir(parents=True, exist_ok=True)
        env = {**os.environ, **secrets, "PYTHONUNBUFFERED": "1"}
        pems = json.loads(env.pop(TLS_PEMS_ENV, "") or "{}")
        if pems:  # under the run's private directory, one of the node's own in it
            private = work / PRIVATE_DIR
            make_private_dir(private)
            tls = private / self.spec["name"]
            write_private_files(tls, pems)
            env["JETCTL_TLS_DIR"] = str(tls)
        argv = list(self.spec["argv"])
        if argv and argv[0] == PYTHON:
            argv[0] = sys.executable
        log_path = work / "logs" / f"{self.spec['name']}.log"
        with open(log_path, "ab") as out:
            out.write(f"\n--- jetctl: starting {self.spec['name']}: {' '.join(argv)}\n".encode())
            self.proc = subprocess.Popen(
                [sys.executable, "-c", _DIE_WITH_PARENT, *argv], stdout=out,
                stderr=subprocess.STDOUT, env=env, cwd=str(work), start_new_session=True,
            )
        self.started_at = time.time()

    def info(self) -> dict[str, Any]:
        """What the controller lists and adopts by; never the node's environment (its
        credential, the TLS keys' text): anyone who can call the actor can read this."""
        return {
            "spec": {k: v for k, v in self.spec.items() if k != "env"},  # an older jetctl's kept env
            "pid": self.proc.pid if self.proc else 0,
            "host": socket.gethostname(), "started_at": self.started_at,
            "running": self.proc is not None and self.proc.poll() is None,
            "error": self.error,
        }

    def poll(self) -> tuple[bool, int | None]:
        """(running, exit code). Not started yet counts as running, as an actor not placed
        yet does: `start` may still be on its way (this actor runs calls concurrently)."""
        if self.proc is None:
            return not self.error, None
        code = self.proc.poll()
        return code is None, code

    def signal(self, signum: int) -> None:
        """To the node only, as the process runtime does: SIGTERM drains it and it stops what
        it started. Sent to its process group it also killed the forkserver its rollouts
        start from, failing a rollout that started at that moment (EOFError)."""
        if self.proc is not None and self.proc.poll() is None:
            self.proc.send_signal(signum)

    def kill(self) -> int | None:
        """SIGKILL the node's whole session (its rollouts too); its exit code."""
        if self.proc is None:
            return None
        from jetctl import proctree

        proctree.kill_session(self.proc.pid)
        try:
            return self.proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            return None


# PR_SET_PDEATHSIG (1): SIGKILL the node when the actor's process dies (Linux), then exec it
_DIE_WITH_PARENT = (
    "import ctypes, os, sys\n"
    "try:\n    ctypes.CDLL('libc.so.6').prctl(1, 9)\nexcept OSError:\n    pass\n"
    "os.execvp(sys.argv[1], sys.argv[1:])"
)


class PrivateDirError(RuntimeError):
    """A directory that should hold a run's keys is not one only this user can enter."""


def _open_private_dir(path: Path) -> int:
    """`path` as a directory only this user can enter: made 0700 (mkdir fails on any
    existing name, a symlink included), or an existing one checked. Returns an fd of it
    opened with O_NOFOLLOW, so a symlink swapped in after the check is not followed.
    Refused (PrivateDirError): a symlink, not a directory, another owner, group or other
    permission bits; each says what to do."""
    try:
        os.mkdir(path, 0o700)
    except FileExistsError:
        pass
    try:
        fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW)
    except OSError as e:  # ELOOP: a symlink; ENOTDIR: a file
        raise PrivateDirError(
            f"{path} is not a plain directory ({e.strerror}): remove it, and the run makes "
            "it again, 0700"
        ) from None
    try:
        st = os.fstat(fd)
        if st.st_uid != os.geteuid():
            raise PrivateDirError(
                f"{path} is owned by uid {st.st_uid}, not this user ({os.geteuid()}): "
                "another user could read the run's keys; remove it"
            )
        if stat.S_IMODE(st.st_mode) & 0o077:
            raise PrivateDirError(
                f"{path} has mode {stat.S_IMODE(st.st_mode):o}: others could read the run's "
                f"keys; chmod 700 {path}, or remove it"
            )
    except BaseException:
        os.close(fd)
        raise
    return fd


def make_private_dir(path: Path) -> None:
    """`path` made, or found, a directory only this user can enter (`_open_private_dir`)."""
    os.close(_open_private_dir(path))


def write_private_files(directory: Path, files: dict[str, str]) -> None:
    """Write each `{name: text}` into `directory` (made or checked 0700) as a new file,
    0600: an old file of that name (a restarted node's) is unlinked first, and the new one
    is created with O_EXCL | O_NOFOLLOW through the directory's fd, so no symlink planted
    there redirects the write."""
    fd = _open_private_dir(directory)
    try:
        for name, text in files.items():
            if not name or name in (".", "..") or "/" in name:
                raise PrivateDirError(f"{name!r} is not a plain file name")
            try:
                os.unlink(name, dir_fd=fd)
            except FileNotFoundError:
                pass
            out = os.open(
                name, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o600, dir_fd=fd
            )
            with os.fdopen(out, "w") as f:
                os.fchmod(f.fileno(), 0o600)  # whatever the umask left
                f.write(text)
    finally:
        os.close(fd)


class RayRuntime(Runtime):
    """Nodes as detached actors in one Ray namespace (see the module docstring)."""

    name = "ray"

    def __init__(self, run: str, cfg: RayConfig) -> None:
        try:
            import ray
        except ImportError:
            raise RuntimeUnavailable(
                "the ray package is not installed: pip install 'jetctl[ray]'"
            ) from None
        self._ray = ray
        self.namespace = cfg.namespace or f"jetctl-{run}"
        self.runtime_env = dict(cfg.runtime_env)
        self.work_root = cfg.work_dir
        extra: dict[str, Any] = {}
        if cfg.address and cfg.address != "auto":
            # this host's address towards the head: Ray's own guess dials a public address
            extra["_node_ip_address"] = route_address(cfg.address)
        try:
            ray.init(
                address=cfg.address, namespace=self.namespace, ignore_reinit_error=True,
                logging_level=logging.WARNING, log_to_driver=False, **extra,
            )
        except (ConnectionError, RuntimeError, ValueError) as e:
            raise RuntimeUnavailable(
                f"cannot reach the Ray cluster at run.ray.address={cfg.address!r}: {e}"
            ) from None
        self.node_ip = str(ray.util.get_node_ip_address())
        self._actor_class = ray.remote(NodeProcess)
        self._actors: dict[str, Any] = {}  # node name -> actor handle

    def work_dir(self) -> str:
        return str(Path(self.work_root) / self.namespace)

    # -- the interface ------------------------------------------------------------------

    def start(self, spec: NodeSpec) -> NodeHandle:
        from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

        p = spec.placement
        if p is None:
            raise ValueError(f"{spec.name}: the ray runtime needs spec.placement")
        self._remove_actor(spec.name)  # a dead one of this name (its restart)
        pg = self._group(p)
        res = dict(p.resources)
        # the creation arguments hold no secret: Ray keeps them for the actor's life. The
        # environment goes in one `start` call, which Ray does not retry (max_task_retries=0)
        # and so does not keep once it ran (see the module docstring)
        actor: Any = self._actor_class.options(
            name=spec.name, namespace=self.namespace, lifetime="detached", max_restarts=0,
            max_task_retries=0, max_concurrency=4,
            num_cpus=res.pop("CPU", 0.0), num_gpus=res.pop("GPU", 0.0),
            memory=res.pop("memory", None), resources=res or None,
            scheduling_strategy=PlacementGroupSchedulingStrategy(
                pg, placement_group_bundle_index=p.index
            ),
            runtime_env=self.runtime_env or None,
        ).remote(_spec_json(spec))
        actor.start.remote(dict(spec.env))  # its result unread: `poll` sees a failed start
        # returns at once: Ray places it when the group's resources are free, and `poll`
        # sees it run (or die)
        self._actors[spec.name] = actor
        return NodeHandle(spec=spec, pid=None, runtime="ray", started_at=time.time())

    def poll(self, handle: NodeHandle) -> NodeState:
        ray = self._ray
        actor = self._actor(handle.spec.name)
        if actor is None:
            return NodeState(running=False)
        try:
            running, code = ray.get(actor.poll.remote(), timeout=POLL_TIMEOUT_S)
        except ray.exceptions.GetTimeoutError:
            return NodeState(running=True)  # still being placed, or busy: not dead
        except ray.exceptions.RayActorError:
            return NodeState(running=False)
        return NodeState(running=bool(running), exit_code=code)

    def terminate(self, handle: NodeHandle) -> None:
        actor = self._actor(handle.spec.name)
        if actor is not None:
            actor.signal.remote(int(signal.SIGTERM))

    def kill(self, handle: NodeHandle) -> None:
        ray = self._ray
        actor = self._actor(handle.spec.name)
        if actor is None:
            return
        try:
            ray.get(actor.kill.remote(), timeout=CALL_TIMEOUT_S)
        except (ray.exceptions.GetTimeoutError, ray.exceptions.RayActorError):
            pass
        self._remove_actor(handle.spec.name)

    def list(self, run: str = "") -> builtins.list[NodeHandle]:
        """The run's actors whose node still runs (to adopt after a controller restart)."""
        out: builtins.list[NodeHandle] = []
        for _name, info in self._infos():
            if info["running"]:
                out.append(NodeHandle(spec=_spec_from(info["spec"]), runtime="ray",
                                      adopted=True, started_at=float(info["started_at"])))
        return out

    def _infos(self) -> Iterator[tuple[str, dict[str, Any]]]:
        """(name, info) of each of the run's actors that answers within CALL_TIMEOUT_S."""
        ray = self._ray
        for name in self._names():
            actor = self._actor(name)
            if actor is None:
                continue
            try:
                yield name, ray.get(actor.info.remote(), timeout=CALL_TIMEOUT_S)
            except (ray.exceptions.GetTimeoutError, ray.exceptions.RayActorError):
                continue

    def release(self, handle: NodeHandle) -> None:
        self._remove_actor(handle.spec.name)

    def prune(self, run: str = "") -> int:
        """Remove exited actors, and placement groups no live actor uses."""
        live_groups: set[str] = set()
        removed = 0
        for name, info in self._infos():
            if info["running"] or not info["started_at"]:  # running, or not started yet
                live_groups.add(info["spec"]["placement"]["group"])
            else:
                self._remove_actor(name)
                removed += 1
        for group in self._groups():
            if group not in live_groups:
                self._remove_group(group)
        return removed

    def release_group(self, group: str) -> None:
        """Remove the placement group: its bundles' resources go back to the cluster (a
        swap's next revision needs them; else only `prune` at the end frees them)."""
        self._remove_group(group)

    def close(self) -> None:
        self._ray.shutdown()

    # -- actors and placement groups ----------------------------------------------------

    def _names(self) -> builtins.list[str]:
        found = self._ray.util.list_named_actors(all_namespaces=True)
        return sorted(
            str(a["name"]) for a in found
            if isinstance(a, dict) and a.get("namespace") == self.namespace
        )

    def _actor(self, name: str) -> Any:
        actor = self._actors.get(name)
        if actor is None:
            try:
                actor = self._ray.get_actor(name, namespace=self.namespace)
            except ValueError:
                return None
            self._actors[name] = actor
        return actor

    def _remove_actor(self, name: str) -> None:
        """Kill the actor and wait until its name is free (a restart reuses it)."""
        actor = self._actor(name)
        self._actors.pop(name, None)
        if actor is None:
            return
        try:
            self._ray.kill(actor, no_restart=True)
        except self._ray.exceptions.RayActorError:
            pass
        deadline = time.monotonic() + CALL_TIMEOUT_S
        while time.monotonic() < deadline:
            try:
                self._ray.get_actor(name, namespace=self.namespace)
            except ValueError:
                return
            time.sleep(0.1)
        log.warning("ray actor %s still named %.0fs after it was killed", name, CALL_TIMEOUT_S)

    def _pg_name(self, group: str) -> str:
        return f"{self.namespace}/{group}"

    def _group(self, p: Placement) -> Any:
        """The placement group of `p.group`, made (detached, SPREAD) the first time."""
        util = self._ray.util
        try:
            return util.get_placement_group(self._pg_name(p.group))
        except ValueError:
            pass
        bundle = {k: v for k, v in p.resources if v}
        return util.placement_group(
            [dict(bundle) for _ in range(p.bundles)], strategy="SPREAD",
            name=self._pg_name(p.group), lifetime="detached",
        )

    def _groups(self) -> builtins.list[str]:
        prefix = f"{self.namespace}/"
        table = self._ray.util.placement_group_table()
        return [
            str(info["name"])[len(prefix):] for info in table.values()
            if str(info.get("name", "")).startswith(prefix) and info.get("state") != "REMOVED"
        ]

    def _remove_group(self, group: str) -> None:
        util = self._ray.util
        try:
            util.remove_placement_group(util.get_placement_group(self._pg_name(group)))
        except ValueError:
            pass


def _spec_json(spec: NodeSpec) -> dict[str, Any]:
    """The actor's creation argument, which Ray keeps for the actor's life: enough to run
    the node and to adopt it later, and no secret (`spec.env` goes in `start`)."""
    p = spec.placement
    assert p is not None
    return {
        "name": spec.name, "kind": spec.kind, "argv": list(spec.argv), "model": spec.model,
        "task": spec.task, "index": spec.index, "revision": spec.revision,
        "labels": dict(spec.labels), "work_dir": p.work_dir,
        "log_path": str(spec.log_path),
        "placement": {"group": p.group, "bundles": p.bundles, "index": p.index,
                      "resources": [list(r) for r in p.resources], "work_dir": p.work_dir},
    }


def _spec_from(d: dict[str, Any]) -> NodeSpec:
    p = d["placement"]
    return NodeSpec(
        name=d["name"], kind=d["kind"], argv=list(d["argv"]), log_path=Path(d["log_path"]),
        model=d["model"], task=d["task"], index=int(d["index"]), revision=d["revision"],
        env={}, labels=dict(d["labels"]),
        placement=Placement(
            group=p["group"], bundles=int(p["bundles"]), index=int(p["index"]),
            resources=tuple((str(k), float(v)) for k, v in p["resources"]),
            work_dir=p["work_dir"],
        ),
    )
