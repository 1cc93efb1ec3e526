"""A hostile agent inside a client container cannot reach the run's secrets, the server's
state, the admin calls or the host, and cannot take the run down with it.

A real controller (in this process), a real `jetctl server` of builtin:tiny on loopback and
one client container (`jetctl-base`) whose agent is tests/security/hostile/hostile_agent.py,
mounted read-only with the runtime's `extra_mounts`. On its first rollout the agent tries:
reading the run token, run.json, TLS keys, the checkpoint key, the store; writing a checkpoint
and run.json; the controller's Down, SwapClients and Status, another node's Sync and Join, a
server's Status, all with its own credential; a port of this host that a service of the test
listens on (0.0.0.0); a fork bomb; filling its disk. It writes what happened into its spool
folder. We check each attempt failed or was contained, that the run kept training (the
version rose after the attack), the refusals were counted, and the ledger balances.

The only non-loopback address used is the gateway of the run's own docker network.
Needs dockerd and `jetctl-base` (`scripts/ci-services.sh`); under CI=true a missing part fails.
"""

from __future__ import annotations

import json
import socket
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from jetctl.controller.controller import Controller
from jetctl.controller.probe import ServerProbe
from jetctl.controller.runtimes.base import Mount
from jetctl.run.ledger import build_ledger
from tests.controller.controller_fakes import FAST, Running, wait_for, write_recipe
from tests.controller.docker_support import (
    BASE_IMAGE,
    containers_of,
    docker_or_skip,
    networks_of,
)

pytestmark = [pytest.mark.docker, pytest.mark.timeout(600)]

HOSTILE = Path(__file__).with_name("hostile")
PIDS = 256
TMP_BYTES = 256 << 20  # the runtime's default /tmp tmpfs


def recipe() -> dict[str, Any]:
    return {
        # mtls: the container gets the client's files, never a key of the server or the CA
        "run": {"name": "hostile", "restart_backoff_s": 0.5, "tls": {"mode": "mtls"}},
        "models": {"policy": {
            "model": "builtin:tiny", "finetune": "full", "optimizer": {"lr": 2.0e-3},
            "train": {"groups_per_step": 1, "max_staleness": 4},
            "checkpoint": {"every_steps": 3},
        }},
        "tasks": {
            "digits": {
                "env": "envs.digits:make_env", "agent": "hostile_agent:agent",
                "model": "policy", "clients": 1, "group_size": 4, "concurrency": 4,
                "sampling": {"max_tokens": 4}, "runtime": "docker", "image": BASE_IMAGE,
                "resources": {"cpus": 1.0, "memory": "1g", "pids": PIDS},
            },
            # an honest node beside it (a process): the run must go on training with it
            "honest": {
                "env": "envs.digits:make_env", "agent": "agents.digits:agent",
                "model": "policy", "clients": 1, "group_size": 4, "concurrency": 4,
                "sampling": {"max_tokens": 4},
            },
        },
    }


@pytest.fixture
def host_service() -> Iterator[int]:
    """A service of this host listening on every address, as a host's other services do."""
    srv = socket.socket()
    srv.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    srv.bind(("0.0.0.0", 0))
    srv.listen()
    srv.settimeout(0.5)
    stop = threading.Event()

    def serve() -> None:
        while not stop.is_set():
            try:
                conn, _ = srv.accept()
                conn.close()
            except OSError:
                continue

    t = threading.Thread(target=serve, daemon=True)
    t.start()
    yield int(srv.getsockname()[1])
    stop.set()
    t.join(timeout=2)
    srv.close()


def test_a_hostile_agent_is_contained_and_the_run_keeps_training(
    tmp_path: Path, host_service: int
) -> None:
    from jetctl.controller.runtimes.docker import DockerRuntime

    client = docker_or_skip()
    run_dir = (tmp_path / "run").resolve()
    agent_dir = tmp_path / "hostile"
    agent_dir.mkdir()
    (agent_dir / "hostile_agent.py").write_text((HOSTILE / "hostile_agent.py").read_text())
    (agent_dir / "target.json").write_text(json.dumps({"host_port": host_service, "pids": PIDS}))
    data = recipe()
    rec, path = write_recipe(tmp_path, data)
    runtime = DockerRuntime(
        run_dir, extra_mounts=(Mount(agent_dir, target=Path("/opt/hostile")),),
        extra_env={"PYTHONPATH": "/opt/hostile"},
    )
    ctl = Controller(rec, path, run_dir=run_dir, runtimes={"docker": runtime}, options=FAST)
    r = Running(ctl).start()
    report_path = run_dir / "containers" / "digits-0" / "spool" / "attack.json"
    try:
        server = ServerProbe(f"127.0.0.1:{ctl.state.nodes['server-policy'].port}", ctl.token,
                             tls=ctl.tls)

        def version() -> int:
            status = server.status()
            return int(status["model_version"]) if status else -1

        wait_for(
            lambda: report_path.is_file() and json.loads(report_path.read_text()).get("done"),
            timeout_s=300, what="the hostile agent's report",
        )
        at_attack = version()
        wait_for(lambda: version() >= at_attack + 3, timeout_s=180,
                 what="training to go on after the attack")
        report = json.loads(report_path.read_text())
        (container,) = containers_of(client, run_dir, all_=False)  # still up
        attrs = container.attrs
        net = networks_of(client, run_dir)[0]
        refused = server.status() or {}
        controller_refused = dict(ctl.refused_calls)
        server.close()
    finally:
        r.stop(grace_s=15)

    # not root, no capability
    assert report["uid"] != 0 and int(report["cap_eff"], 16) == 0, report
    # its token is its node's credential, not the run's
    assert report["token_seen"].startswith("jn1.") and report["token_seen"] != ctl.token
    # nothing of the run's secrets or the server's state is there to read or write
    assert all(v.startswith("refused") for v in report["read"].values()), report["read"]
    assert all(v.startswith("refused") for v in report["write"].values()), report["write"]
    assert set(report["spool_listing"]) <= {
        "digits-0.sqlite", "digits-0.sqlite-wal", "digits-0.sqlite-shm", "digits-0.rollouts",
        "attack.json",  # its own report
    }, report["spool_listing"]
    assert report["tls_listing"] == ["ca.pem", "client.key", "client.pem"], report
    # admin calls and another node's calls are refused; its own Sync is not
    control = report["control"]
    for call in ("Down", "SwapClients", "Status", "Sync_as_other", "Join_as_other"):
        assert control[call] == "PERMISSION_DENIED", (call, control)
    assert control["Down_guessed_token"] == "UNAUTHENTICATED"
    assert control["Sync_as_self"] == "OK", "the credential works for what a node does"
    assert report["server"]["Status"] == "PERMISSION_DENIED"
    # and counted
    assert controller_refused.get("permission_denied", 0) >= 5, controller_refused
    assert controller_refused.get("unauthenticated", 0) >= 1, controller_refused
    assert int(refused["refused_calls"].get("permission_denied", 0)) >= 1, refused  # int64: str
    # the host: only the controller and the server answer on the network's gateway
    assert report["connect"]["controller"] == "CONNECTED"
    assert report["connect"]["host_other_port"].startswith("refused"), report["connect"]
    assert net.attrs["Internal"] is True, "no route out of the run's network"
    # a fork bomb stops at the pids limit, a disk fill at the tmpfs's size
    bomb = report["fork_bomb"]
    assert bomb["error"] == "EAGAIN" and 0 < bomb["forks"] < PIDS, bomb
    disk = report["disk"]
    assert disk["error"] == "ENOSPC" and disk["written"] <= TMP_BYTES, disk
    assert disk["root"] == "refused: EROFS", disk
    # what docker shows: the node's spool and log, the agent read-only, nothing else
    mounts = {m["Destination"]: (m["Source"], m["RW"]) for m in attrs["Mounts"]}
    assert mounts == {
        str(run_dir / "spool"): (str(run_dir / "containers" / "digits-0" / "spool"), True),
        str(run_dir / "logs" / "digits-0.log"): (str(run_dir / "logs" / "digits-0.log"), True),
        str(run_dir / "logs" / "digits-0.jsonl"): (str(run_dir / "logs" / "digits-0.jsonl"), True),
        "/opt/hostile": (str(agent_dir), False),
        **{f"/run/jetctl/tls/{f}": (str(run_dir / "tls" / f), False) for f in ("ca.pem", "client.pem")},
        "/run/jetctl/tls/client.key": (
            str(run_dir / "containers" / "digits-0" / "secrets" / "client.key"), False),
    }, mounts
    host = attrs["HostConfig"]
    assert host["CapDrop"] == ["ALL"] and host["ReadonlyRootfs"] is True
    assert host["PidsLimit"] == PIDS and host["NetworkMode"] == net.name
    # the run went on and its books balance
    assert not containers_of(client, run_dir), "no container outlives the run"
    ledger = build_ledger(run_dir)
    assert ledger.balanced, ledger.summary()["problems"]
    assert ledger.trained > 0
