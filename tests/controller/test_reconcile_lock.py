"""The reconciler calls its runtimes outside the run state's lock: a slow start (a docker
call takes seconds) or a slow SIGKILL does not hold up `Control.Status` (which reads the run
under that lock), and a drain that begins while a node starts wins (the new node is stopped).
The runtime here is an in-memory fake whose calls sleep; no process is started."""

from __future__ import annotations

import builtins
import threading
import time
from pathlib import Path

import pytest

from jetctl.controller.reconcile import ControllerOptions, JetctlCommands, Reconciler
from jetctl.controller.runtimes.base import NodeHandle, NodeSpec, NodeState, Runtime
from jetctl.controller.state import RunState
from jetctl.rundir import RunPaths
from tests.controller.controller_fakes import recipe_dict, write_recipe

pytestmark = pytest.mark.unit

SLOW_S = 2.0  # how long the fake runtime's start and kill take
QUICK_S = 0.5  # what a Status read may take meanwhile


class SlowRuntime(Runtime):
    """Nodes in memory; `start` and `kill` sleep `SLOW_S` (a docker run, a container's
    SIGKILL and wait). Its nodes ignore SIGTERM when `stubborn`."""

    name = "process"

    def __init__(self, stubborn: bool = False) -> None:
        self.stubborn = stubborn
        self.in_start = threading.Event()
        self.in_kill = threading.Event()
        self.running: set[int] = set()
        self.stopped: list[int] = []
        self.released: list[int] = []
        self._next_pid = 1000

    def start(self, spec: NodeSpec) -> NodeHandle:
        self.in_start.set()
        time.sleep(SLOW_S)
        self._next_pid += 1
        self.running.add(self._next_pid)
        return NodeHandle(spec=spec, pid=self._next_pid)

    def poll(self, handle: NodeHandle) -> NodeState:
        return NodeState(running=handle.pid in self.running, exit_code=None)

    def terminate(self, handle: NodeHandle) -> None:
        if not self.stubborn:
            self._end(handle)

    def kill(self, handle: NodeHandle) -> None:
        self.in_kill.set()
        time.sleep(SLOW_S)
        self._end(handle)

    def list(self, run: str) -> builtins.list[NodeHandle]:
        return []

    def release(self, handle: NodeHandle) -> None:
        assert handle.pid is not None
        self.released.append(handle.pid)

    def _end(self, handle: NodeHandle) -> None:
        assert handle.pid is not None
        if handle.pid in self.running:
            self.running.discard(handle.pid)
            self.stopped.append(handle.pid)


def reconciler(tmp_path: Path, runtime: Runtime) -> Reconciler:
    recipe, path = write_recipe(tmp_path, recipe_dict(clients=1))
    state = RunState(recipe, path, RunPaths(tmp_path / "run"))
    commands = JetctlCommands(path, tmp_path / "run")
    r = Reconciler(
        state, runtime=runtime, runtimes={}, commands=commands, container_commands=commands,
        options=ControllerOptions(), kill_now=threading.Event(),
    )
    r.control, r.token = "127.0.0.1:7000", "tok"
    r.build_nodes({})
    return r


def in_thread(target: object, *args: object) -> threading.Thread:
    t = threading.Thread(target=target, args=args, daemon=True)  # type: ignore[arg-type]
    t.start()
    return t


def status_seconds(state: RunState) -> float:
    t0 = time.monotonic()
    state.status()
    return time.monotonic() - t0


def test_a_slow_start_does_not_hold_up_status(tmp_path: Path) -> None:
    rt = SlowRuntime()
    r = reconciler(tmp_path, rt)
    tick = in_thread(r.tick)  # starts the server: SLOW_S in the runtime
    assert rt.in_start.wait(5.0)

    took = status_seconds(r.state)
    states = {n.name: n.state for n in r.state.status().nodes}

    assert took < QUICK_S, f"Status waited {took:.2f}s on a start of {SLOW_S}s"
    assert states == {"server-policy": "pending", "arith-0": "pending"}
    tick.join(timeout=2 * SLOW_S + 5)  # the server's start, then the client's
    server = r.state.nodes["server-policy"]
    assert server.state == "starting" and server.handle is not None
    assert server.last_pid == server.handle.pid and server.started_at > 0


def test_a_drain_during_a_start_stops_the_new_node(tmp_path: Path) -> None:
    rt = SlowRuntime()
    r = reconciler(tmp_path, rt)
    server = r.state.nodes["server-policy"]
    tick = in_thread(r.tick)
    assert rt.in_start.wait(5.0)

    t0 = time.monotonic()
    r.drain_nodes([server], grace_s=5.0, what="server")  # nothing runs yet: done at once
    assert time.monotonic() - t0 < QUICK_S
    assert server.state == "exited"
    tick.join(timeout=2 * SLOW_S + 5)

    assert server.state == "exited" and server.handle is None, "the drain won"
    # the same tick started the client (1002) after the server: clients start with servers
    assert rt.stopped == [1001] and rt.released == [1001] and rt.running == {1002}
    r.tick()  # an exited node stays down
    assert server.state == "exited" and rt.running == {1002}


def test_a_slow_sigkill_at_the_end_of_a_drain_does_not_hold_up_status(
    tmp_path: Path,
) -> None:
    rt = SlowRuntime(stubborn=True)
    r = reconciler(tmp_path, rt)
    r.tick()
    server = r.state.nodes["server-policy"]
    assert server.handle is not None
    drain = in_thread(r.drain_nodes, [server], 0.2, "server")  # SIGTERM ignored: SIGKILL
    assert rt.in_kill.wait(5.0)

    took = status_seconds(r.state)

    assert took < QUICK_S, f"Status waited {took:.2f}s on a kill of {SLOW_S}s"
    drain.join(timeout=SLOW_S + 5)
    assert server.state == "exited" and server.handle is None
    assert rt.stopped == [1001] and rt.released == [1001]
