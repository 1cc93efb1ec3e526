"""The `process` runtime: every node is a subprocess on this host.

Each node runs in its own session and process group (`start_new_session=True`), so a Ctrl-C
at the controller's terminal does not reach it. A kill takes the node's whole session: its
own group and its rollouts, which are process groups of their own (jetctl/proctree.py). Its
stdout+stderr go to `<run_dir>/logs/<node>.log` (appended across restarts) and
`<run_dir>/pids/<node>.pid` records it (JSON: pid, process start time, spec) so that a new
controller can adopt it (`jetctl up --resume`) or `jetctl down` can stop it without one.
The start time guards against a recycled pid. Left out: limits (use docker).
"""

from __future__ import annotations

import builtins
import os
import signal
import subprocess
import time
from pathlib import Path

from jetctl import proctree
from jetctl.controller.runtimes.base import NodeHandle, NodeSpec, NodeState, Runtime
from jetctl.proctree import pid_alive, process_create_time
from jetctl.rundir import RunPaths, read_json, write_json_atomic


class ProcessRuntime(Runtime):
    """Subprocesses on this host, recorded under `<run_dir>/pids/`."""

    name = "process"

    def __init__(self, run_dir: Path) -> None:
        self.run_dir = Path(run_dir)
        self.paths = RunPaths(self.run_dir)
        self.pid_dir = self.paths.pids
        self._children: dict[int, subprocess.Popen[bytes]] = {}

    # -- the interface ------------------------------------------------------------------

    def start(self, spec: NodeSpec) -> NodeHandle:
        spec.log_path.parent.mkdir(parents=True, exist_ok=True)
        self.pid_dir.mkdir(parents=True, exist_ok=True)
        env = {**os.environ, "PYTHONUNBUFFERED": "1", **spec.env}
        with open(spec.log_path, "ab") as log:
            log.write(f"\n--- jetctl: starting {spec.name}: {' '.join(spec.argv)}\n".encode())
            log.flush()
            proc = subprocess.Popen(
                spec.argv,
                stdin=subprocess.DEVNULL,
                stdout=log,
                stderr=subprocess.STDOUT,
                env=env,
                cwd=spec.cwd,
                start_new_session=True,
            )
        self._children[proc.pid] = proc
        handle = NodeHandle(spec=spec, pid=proc.pid, started_at=time.time())
        self._write_pid_file(handle, process_create_time(proc.pid))
        return handle

    def poll(self, handle: NodeHandle) -> NodeState:
        if handle.pid is None:
            return NodeState(running=False)
        proc = self._children.get(handle.pid)
        if proc is not None:
            code = proc.poll()
            return NodeState(running=code is None, exit_code=code)
        return NodeState(running=pid_alive(handle.pid, self._recorded_create_time(handle)))

    def terminate(self, handle: NodeHandle) -> None:
        # SIGTERM to the node only: it drains and stops what it started itself
        if handle.pid is not None and self.poll(handle).running:
            _signal(handle.pid, signal.SIGTERM, group=False)

    def kill(self, handle: NodeHandle) -> None:
        if handle.pid is None:
            return
        _signal(handle.pid, signal.SIGKILL, group=True)
        # the node's rollouts are process groups of their own in its session: reach them too
        proctree.kill_session(handle.pid)
        proc = self._children.get(handle.pid)
        if proc is not None:
            try:
                proc.wait(timeout=5)
            except subprocess.TimeoutExpired:
                pass

    def list(self, run: str = "") -> builtins.list[NodeHandle]:
        """Running nodes recorded in the pid files (`run` is implied by the run dir)."""
        handles: builtins.list[NodeHandle] = []
        if not self.pid_dir.is_dir():
            return handles
        for path in sorted(self.pid_dir.glob("*.pid")):
            rec = read_json(path)
            if rec is None:
                continue
            pid = int(rec["pid"])
            if not pid_alive(pid, float(rec.get("create_time") or 0.0)):
                continue
            spec = NodeSpec(
                name=str(rec["name"]),
                kind=rec["kind"],
                argv=[str(a) for a in rec.get("argv", [])],
                log_path=Path(rec["log_path"]),
                model=str(rec.get("model", "")),
                task=str(rec.get("task", "")),
                index=int(rec.get("index", 0)),
                revision=str(rec.get("revision", "r0")),
                labels={str(k): str(v) for k, v in rec.get("labels", {}).items()},
            )
            handles.append(
                NodeHandle(spec=spec, pid=pid, started_at=float(rec["started_at"]), adopted=True)
            )
        return handles

    def release(self, handle: NodeHandle) -> None:
        rec = read_json(self._pid_path(handle.spec.name))
        if rec is not None and rec.get("pid") == handle.pid:
            self._pid_path(handle.spec.name).unlink(missing_ok=True)
        if handle.pid is not None:
            self._children.pop(handle.pid, None)

    # -- pid files ----------------------------------------------------------------------

    def _pid_path(self, name: str) -> Path:
        return self.paths.pid_file(name)

    def _write_pid_file(self, handle: NodeHandle, create_time: float) -> None:
        s = handle.spec
        rec = {
            "pid": handle.pid,
            "create_time": create_time,
            "started_at": handle.started_at,
            "name": s.name,
            "kind": s.kind,
            "model": s.model,
            "task": s.task,
            "index": s.index,
            "revision": s.revision,
            "argv": s.argv,
            "log_path": str(s.log_path),
            "labels": s.labels,
        }
        write_json_atomic(self._pid_path(s.name), rec)

    def _recorded_create_time(self, handle: NodeHandle) -> float:
        rec = read_json(self._pid_path(handle.spec.name))
        if rec is None or rec.get("pid") != handle.pid:
            return 0.0
        return float(rec.get("create_time") or 0.0)


def _signal(pid: int, sig: signal.Signals, group: bool) -> None:
    try:
        if group:
            os.killpg(pid, sig)  # start_new_session: the node's pgid is its pid
        else:
            os.kill(pid, sig)
    except (ProcessLookupError, PermissionError):
        pass
