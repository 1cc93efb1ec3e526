"""The start order: a task's client nodes start with their model's server, not after it.

A node starts its rollouts while its server loads; their model calls wait in the node's
proxy until the server answers Register, then succeed: nothing fails or is dropped because
the server was still loading. First the reconciler's first pass (a ray task keeps the old
order); then a node against a fake server that starts only once the node's rollouts are
waiting on it; then `jetctl up` with a real controller, a builtin:tiny server and two client
nodes: the controller's log starts the clients before the server is up, the run trains, and
its ledger balances with nothing dropped.
"""

from __future__ import annotations

import asyncio
import builtins
import re
import threading
import time
from pathlib import Path

import pytest

from jetctl.client.node import ClientNode, NodeConfig
from jetctl.controller.reconcile import ControllerOptions, JetctlCommands, Reconciler
from jetctl.controller.runtimes.base import NodeHandle, NodeSpec, NodeState, Runtime
from jetctl.controller.state import Report, RunState
from jetctl.models import tokenizer_from_files
from jetctl.recipe import TaskConfig, parse_recipe
from jetctl.run.ledger import build_ledger
from jetctl.rundir import RunPaths
from tests.client.client_fakes import TOKEN, FakeSwarm, start_fake_server, tiny_tokenizer_files
from tests.controller.controller_fakes import wait_for
from tests.runs import detached_run, step_rows

FAKES = "tests.client.client_fakes"

TWO_RUNTIMES = """
run: {name: t, ray: {address: 10.0.0.5:6379}}
models:
  policy: {model: builtin:tiny}
tasks:
  digits: {env: envs.digits:make_env, agent: agents.digits:agent, model: policy, clients: 2}
  web:
    env: envs.digits:make_env
    agent: agents.digits:agent
    model: policy
    clients: 1
    runtime: ray
"""


class Started(Runtime):
    """Nodes in memory that run until told otherwise; `started` names them in order. It
    stands in for the process and the ray runtime (only the ray one's work dir is read)."""

    def __init__(self, name: str, started: list[str]) -> None:
        self.name = name
        self.started = started
        self._pid = 1000

    def start(self, spec: NodeSpec) -> NodeHandle:
        self.started.append(spec.name)
        self._pid += 1
        return NodeHandle(spec=spec, pid=self._pid, runtime=self.name)

    def poll(self, handle: NodeHandle) -> NodeState:
        return NodeState(running=True)

    def terminate(self, handle: NodeHandle) -> None: ...

    def kill(self, handle: NodeHandle) -> None: ...

    def list(self, run: str) -> builtins.list[NodeHandle]:
        return []

    def release(self, handle: NodeHandle) -> None: ...

    def work_dir(self) -> str:
        return "/srv/jetctl/jetctl-t"


@pytest.mark.unit
def test_the_first_pass_starts_the_clients_with_the_server_but_a_ray_tasks_after_it(
    tmp_path: Path,
) -> None:
    started: list[str] = []
    recipe = parse_recipe(TWO_RUNTIMES, file="r.yaml", env={})
    state = RunState(recipe, tmp_path / "r.yaml", RunPaths(tmp_path / "run"))
    commands = JetctlCommands(tmp_path / "r.yaml", tmp_path / "run")
    r = Reconciler(
        state, runtime=Started("process", started), runtimes={"ray": Started("ray", started)},
        commands=commands, container_commands=commands, options=ControllerOptions(),
        kill_now=threading.Event(),
    )
    r.control, r.token = "127.0.0.1:7000", "tok"
    r.build_nodes({})

    r.tick()
    assert started == ["server-policy", "digits-0", "digits-1"], "the server first, same pass"
    r.tick()
    assert started == ["server-policy", "digits-0", "digits-1"], "web waits: its server loads"

    # the server answers health and syncs: it is up, and the ray task's client starts
    state.healthy["policy"] = True
    state.reports["server-policy"] = Report(status={"state": "running"}, received_at=time.time(),
                                            kind="server")
    r.tick()  # sees the server up, then starts what waited for it
    assert started == ["server-policy", "digits-0", "digits-1", "web-0"]


@pytest.mark.integration
@pytest.mark.timeout(120)
async def test_model_calls_made_before_the_server_listens_wait_for_it_and_succeed(
    tmp_path: Path,
) -> None:
    files = tiny_tokenizer_files()
    fake = FakeSwarm(tokenizer_from_files(files), files)
    task = TaskConfig(model="policy", env=f"{FAKES}:make_env", agent=f"{FAKES}:async_agent",
                      group_size=2, concurrency=2)
    node = ClientNode(NodeConfig(
        name="t-0", task_name="echo", task=task, run_dir=tmp_path, token=TOKEN, max_groups=2,
        install_signal_handlers=False, drain_grace_s=10,
    ))
    running = asyncio.create_task(node.run())
    try:
        # no server anywhere yet (no servers/policy.json): the rollouts start all the same,
        # and each one's model call reaches the node's proxy and waits there
        deadline = time.monotonic() + 60
        while (node.proxy is None or node.proxy.requests < 2) and time.monotonic() < deadline:
            assert not running.done(), running
            await asyncio.sleep(0.05)
        assert node.proxy is not None and node.proxy.requests == 2, "both rollouts called"
        assert not fake.registers and node.state != "running"
        assert node.stats.rollouts_failed == node.stats.rollouts_timeout == 0
        server, _ = await start_fake_server(fake, tmp_path)  # writes servers/policy.json
        try:
            assert await asyncio.wait_for(running, 60) == 0
        finally:
            await server.stop(None)
    finally:
        if not running.done():
            running.cancel()
    assert [r.client_id for r in fake.registers] == ["t-0"]
    assert node.stats.rollouts_failed == node.stats.rollouts_timeout == 0
    assert node.stats.dropped == {}, "nothing was dropped while the server was not up"
    assert len(fake.stored) == 2, "both groups were delivered"
    for group in fake.stored.values():
        assert [t.status for t in group.trajectories] == ["ok", "ok"]
        assert all(t.calls for t in group.trajectories), "each rollout's call was answered"


RECIPE = """
run:
  name: start-order
  duration_s: 600
models:
  policy:
    model: builtin:tiny
    finetune: full
    optimizer: {lr: 2.0e-3}
    train: {groups_per_step: 2, max_staleness: 4}
tasks:
  digits:
    env: envs.digits:make_env
    agent: agents.digits:agent
    model: policy
    clients: 2
    group_size: 4
    concurrency: 4
    sampling: {max_tokens: 4}
"""


def _line(lines: list[str], pattern: str) -> int:
    """The index of the first line of the controller's log that matches `pattern`."""
    found = [i for i, line in enumerate(lines) if re.search(pattern, line)]
    assert found, f"no line matches {pattern!r} in the controller's log:\n" + "\n".join(lines)
    return found[0]


@pytest.mark.integration
@pytest.mark.timeout(300)
def test_up_starts_the_clients_with_the_server_and_the_run_trains(tmp_path: Path) -> None:
    recipe = tmp_path / "start-order.yaml"
    recipe.write_text(RECIPE)
    run_dir = tmp_path / "run"
    with detached_run(recipe, run_dir):
        wait_for(lambda: len(step_rows(run_dir)) >= 2, timeout_s=180,
                 what="the run to train two steps")

    paths = RunPaths(run_dir)
    lines = paths.controller_log.read_text().splitlines()
    server_up = _line(lines, r"server-policy is up")
    for client in ("digits-0", "digits-1"):
        assert _line(lines, rf"{client} started, pid") < server_up, f"{client} started first"
    # the server's start says where its time went (imports, loading, engine, ...)
    server_log = paths.log("server-policy").read_text()
    assert re.search(r"started in [\d.]+s: before serve\(\) [\d.]+s .*loading builtin:tiny",
                     server_log), server_log[-2000:]

    ledger = build_ledger(run_dir)
    summary = ledger.summary()
    assert ledger.balanced, summary["problems"]
    assert ledger.trained > 0, summary
    assert summary["dropped"] == {}, "no rollout failed or timed out while the server loaded"
