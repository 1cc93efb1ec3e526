"""The docker runtime on a real engine: labels, limits, isolation, restarts, cleanup,
adoption, swap.

Client nodes are fake_node.py (mounted read-only into every container with the runtime's
`extra_mounts`, as is the events log it appends to) run by the image's Python; the server
is a fake process. Needs dockerd and `jetctl-base` (`scripts/ci-services.sh`). What a hostile
node cannot do is tests/security/test_hostile_client.py.
"""

from __future__ import annotations

import json
import shutil
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from jetctl.controller.controller import Controller, JetctlCommands
from jetctl.controller.runtimes.base import ContainerSpec, Mount, NodeSpec
from jetctl.rundir import RunDirError
from tests.controller.controller_fakes import (
    FAKE_NODE,
    FAST,
    Running,
    events,
    fake_commands,
    node_states,
    read_run_json,
    recipe_dict,
    wait_for,
    write_recipe,
)
from tests.controller.docker_support import (
    BASE_IMAGE,
    containers_of,
    docker_or_skip,
    networks_of,
)

pytestmark = [pytest.mark.docker, pytest.mark.timeout(180)]

RESOURCES = {"cpus": 0.5, "memory": "256m", "pids": 64, "shm": "128m"}


@pytest.fixture
def docker_client(run_dir: Path) -> Iterator[Any]:
    client = docker_or_skip()
    yield client
    for c in containers_of(client, run_dir):  # whatever a failing test left
        c.remove(force=True)
    for n in networks_of(client, run_dir):
        n.remove()


def docker_recipe(clients: int = 2, image: str = BASE_IMAGE) -> dict[str, Any]:
    data = recipe_dict(clients=clients)
    data["tasks"]["arith"].update(runtime="docker", image=image, resources=RESOURCES)
    return data


def docker_controller(tmp_path: Path, run_dir: Path, data: dict[str, Any], **kw: Any) -> Controller:
    """A controller whose servers are fake processes and whose clients are fake nodes in
    containers (fake_node.py and the events log mounted into each by the runtime)."""
    from jetctl.controller.runtimes.docker import DockerRuntime

    recipe, path = write_recipe(tmp_path, data)
    run_dir.mkdir(parents=True, exist_ok=True)
    code = tmp_path / "fake"
    code.mkdir(exist_ok=True)
    shutil.copy(FAKE_NODE, code / "fake_node.py")
    log = run_dir.resolve() / "fake_events.log"
    log.touch()
    log.chmod(0o666)  # the containers' user is not the test's
    runtime = DockerRuntime(run_dir, extra_mounts=(Mount(code), Mount(log, read_only=False)))
    inside = JetctlCommands(path, run_dir.resolve(), prefix=("python", str(code / "fake_node.py")))
    return Controller(
        recipe,
        path,
        run_dir=run_dir,
        commands=fake_commands(path, run_dir),
        runtimes={"docker": runtime},
        container_commands=inside,
        options=FAST,
        **kw,
    )


def test_a_container_is_labelled_limited_and_logged(docker_client: Any, run_dir: Path) -> None:
    from jetctl.controller.runtimes.docker import DockerRuntime

    rt = DockerRuntime(run_dir)
    spec = NodeSpec(
        name="arith-0",
        kind="client",
        argv=[
            "python",
            "-c",
            "import os,time; print('up', os.getuid(), flush=True); time.sleep(60)",
        ],
        log_path=run_dir / "logs" / "arith-0.log",
        task="arith",
        revision="r3",
        labels={"jetctl.run": "t"},
        container=ContainerSpec(image=BASE_IMAGE, cpus=0.5, memory="256m", pids=64, shm="128m"),
    )
    h = rt.start(spec)
    c = docker_client.containers.get(h.container_id)
    assert {
        "jetctl.run": "t",
        "jetctl.task": "arith",
        "jetctl.revision": "r3",
    }.items() <= c.labels.items()
    host = c.attrs["HostConfig"]
    assert host["NanoCpus"] == 500_000_000 and host["Memory"] == 256 * 2**20
    assert host["PidsLimit"] == 64 and host["ShmSize"] == 128 * 2**20
    # isolated: the run's own network, no capability, no new privileges, read-only root
    assert host["NetworkMode"] == rt.network().name != "host"
    assert host["CapDrop"] == ["ALL"] and host["SecurityOpt"] == ["no-new-privileges"]
    assert host["ReadonlyRootfs"] is True and "size=256m" in host["Tmpfs"]["/tmp"]
    # it mounts what the node owns and nothing else of the run dir
    root = run_dir.resolve()
    mounts = {m["Destination"]: (m["Source"], m["RW"]) for m in c.attrs["Mounts"]}
    assert mounts == {
        str(root / "spool"): (str(root / "containers" / "arith-0" / "spool"), True),
        str(root / "logs" / "arith-0.log"): (str(root / "logs" / "arith-0.log"), True),
        str(root / "logs" / "arith-0.jsonl"): (str(root / "logs" / "arith-0.jsonl"), True),
    }
    line = wait_for(
        lambda: [x for x in (run_dir / "logs" / "arith-0.log").read_text().splitlines()
                 if x.startswith("up ")],
        what="the node's log line",
    )
    assert line[0] != "up 0", "not root inside"
    assert [x.container_id for x in rt.list("t")] == [h.container_id]

    rt.terminate(h)  # tini forwards SIGTERM; python without a handler exits on it
    wait_for(lambda: not rt.poll(h).running, timeout_s=15, what="exit on SIGTERM")
    rt.release(h)
    assert containers_of(docker_client, run_dir) == [], "release removes the container"


def test_the_memory_limit_is_enforced(docker_client: Any, run_dir: Path) -> None:
    from jetctl.controller.runtimes.docker import DockerRuntime

    rt = DockerRuntime(run_dir)
    spec = NodeSpec(
        name="hog",
        kind="client",
        argv=["python", "-c", "x = bytearray(400 * 2**20); print(len(x))"],
        log_path=run_dir / "logs" / "hog.log",
        container=ContainerSpec(image=BASE_IMAGE, memory="128m"),
    )
    h = rt.start(spec)
    state = wait_for(
        lambda: (s := rt.poll(h)) and not s.running and s, timeout_s=30, what="the hog"
    )
    assert state.exit_code == 137, "killed by the OOM killer at the 128m cap"
    rt.release(h)


def test_controller_restarts_a_dead_container_and_down_leaves_none(
    docker_client: Any, tmp_path: Path, run_dir: Path
) -> None:
    r = Running(docker_controller(tmp_path, run_dir, docker_recipe(clients=2))).start()
    try:
        wait_for(r.all_running, what="every node running")
        wait_for(
            lambda: (run_dir / "nodes" / "arith-1.json").is_file(), what="a container's node file"
        )
        containers = containers_of(docker_client, run_dir, all_=False)
        assert sorted(c.labels["jetctl.node"] for c in containers) == ["arith-0", "arith-1"]
        assert all(
            c.labels["jetctl.run"] == "t" and c.labels["jetctl.revision"] == "r0"
            for c in containers
        )
        info = read_run_json(run_dir)
        assert {c.id for c in containers} == {v["container_id"] for v in info["clients"].values()}

        victim = next(c for c in containers if c.labels["jetctl.node"] == "arith-0")
        victim.kill()  # a crash: SIGKILL, exit 137
        wait_for(
            lambda: (
                next(n for n in r.ctl.status().nodes if n.name == "arith-0").restarts == 1
                and node_states(r.ctl)["arith-0"] == "running"
            ),
            what="arith-0 restarted",
        )
        now = next(n for n in r.ctl.status().nodes if n.name == "arith-0")
        assert now.container_id and now.container_id != victim.id
        # let the new container's node get going (its SIGTERM handler installed)
        starts = wait_for(
            lambda: [t for t, n, w, _ in events(run_dir) if n == "arith-0" and w == "start"][1:],
            what="the second start",
        )
        restarted_at = starts[0]
        wait_for(
            lambda: (
                json.loads((run_dir / "nodes" / "arith-0.json").read_text())["updated_at"]
                > restarted_at
            ),
            what="the restarted node to report",
        )
    finally:
        assert r.stop(grace_s=10) == "test"
    assert containers_of(docker_client, run_dir) == [], "no container outlives the run"
    ev = events(run_dir)
    # drained, not killed: each node either took SIGTERM or left on the drain its sync was told
    # first (whichever reached it first), and exited on its own
    drained = {n for _, n, w, _ in ev if w in ("sigterm", "drain-asked")}
    assert drained >= {"arith-0", "arith-1"}, ev
    assert {n for _, n, w, _ in ev if w == "exit"} >= {"arith-0", "arith-1"}, ev


def test_up_prunes_exited_containers_and_refuses_or_adopts_running_ones(
    docker_client: Any, tmp_path: Path, run_dir: Path
) -> None:
    first = docker_controller(tmp_path, run_dir, docker_recipe(clients=1))
    r = Running(first).start()
    wait_for(r.all_running, what="every node running")
    # the controller dies without draining: its container keeps running
    first._teardown = lambda: (first._done.set(), first._grpc and first._grpc.stop(0))  # type: ignore[method-assign,func-returns-value]
    first._stop.set()
    r.thread.join(timeout=30)
    stale = docker_client.containers.run(
        BASE_IMAGE,
        ["true"],
        detach=True,
        labels={"jetctl.run": "t", "jetctl.run_dir": str(run_dir.resolve()), "jetctl.node": "old"},
    )
    wait_for(
        lambda: (stale.reload() or stale.status) == "exited", what="the stale container to exit"
    )

    with pytest.raises(RunDirError, match="--resume"):
        docker_controller(tmp_path, run_dir, docker_recipe(clients=1)).setup()
    assert stale.id not in {c.id for c in containers_of(docker_client, run_dir)}, "pruned on up"

    r2 = Running(
        docker_controller(tmp_path, run_dir, docker_recipe(clients=1), resume=True)
    ).start()
    try:
        wait_for(r2.all_running, what="adopted nodes running")
        time.sleep(1.0)
        client_starts = [e for e in events(run_dir) if e[2] == "start" and e[1] == "arith-0"]
        assert len(client_starts) == 1, "the container was adopted, not started again"
    finally:
        r2.stop(grace_s=10)
    assert containers_of(docker_client, run_dir) == []


def test_swap_to_a_new_image_replaces_every_container(
    docker_client: Any, tmp_path: Path, run_dir: Path
) -> None:
    docker_client.images.get(BASE_IMAGE).tag("jetctl-base", "swap-test")
    r = Running(docker_controller(tmp_path, run_dir, docker_recipe(clients=2))).start()
    try:
        wait_for(r.all_running, what="every node running")
        old_ids = {c.id for c in containers_of(docker_client, run_dir, all_=False)}

        result = r.ctl.swap_clients("arith", image="jetctl-base:swap-test", grace_s=10)

        assert result.ok, result.message
        live = containers_of(docker_client, run_dir, all_=False)
        assert not old_ids & {c.id for c in live}, "no old container is left"
        assert sorted(c.labels["jetctl.node"] for c in live) == ["arith-0-r1", "arith-1-r1"]
        assert {c.labels["jetctl.revision"] for c in live} == {"r1"}
        assert {c.attrs["Config"]["Image"] for c in live} == {"jetctl-base:swap-test"}
        assert read_run_json(run_dir)["tasks"]["arith"]["image"] == "jetctl-base:swap-test"
        assert "not built" in r.ctl.swap_clients("arith", image="jetctl-nope:1").message
    finally:
        r.stop(grace_s=10)
        docker_client.images.remove("jetctl-base:swap-test")
    assert containers_of(docker_client, run_dir) == []


def test_down_without_a_controller_stops_and_removes_the_containers(
    docker_client: Any, tmp_path: Path, run_dir: Path
) -> None:
    from jetctl.cli.up import stop_orphans

    ctl = docker_controller(tmp_path, run_dir, docker_recipe(clients=2))
    r = Running(ctl).start()
    wait_for(r.all_running, what="every node running")
    ctl._teardown = lambda: (ctl._done.set(), ctl._grpc and ctl._grpc.stop(0))  # type: ignore[method-assign,func-returns-value]
    ctl._stop.set()  # the controller dies without draining
    r.thread.join(timeout=30)
    assert len(containers_of(docker_client, run_dir, all_=False)) == 2

    assert stop_orphans(run_dir, grace=10) == 3  # the fake server process and two containers
    assert containers_of(docker_client, run_dir) == []
    assert {n for _, n, w, _ in events(run_dir) if w == "sigterm"} >= {"arith-0", "arith-1"}


SANDBOX_PROBE = """
from envs.code.sandbox import Limits, SandboxUnavailable, make_sandbox
try:
    box = make_sandbox("docker", "jetctl-code")
except SandboxUnavailable as e:
    print("UNAVAILABLE", e, flush=True)
    raise SystemExit(0)
r = box.run({"m.py": "import socket\\ntry:\\n    socket.create_connection(('1.1.1.1', 53), 1)\\n"
             "    print('NET')\\nexcept OSError:\\n    print('no net')\\nprint(6 * 7)"},
            ["m.py"], Limits(time_s=5.0))
print("RESULT", r.backend, r.exit_code, " ".join(r.stdout.split()), flush=True)
"""


@pytest.mark.parametrize("socket", [True, False])
def test_a_node_given_the_docker_socket_runs_code_in_sibling_sandboxes(
    docker_client: Any, run_dir: Path, socket: bool
) -> None:
    """The code env inside a client container (cocktail's code task): with docker_socket its
    sandbox runs as a sibling container, cut off from the network; without, it says why not."""
    from jetctl.controller.runtimes.docker import DockerRuntime

    docker_or_skip("jetctl-code")
    rt = DockerRuntime(run_dir)
    log = run_dir / "logs" / "code-0.log"
    h = rt.start(NodeSpec(
        name="code-0", kind="client", argv=["python", "-c", SANDBOX_PROBE], log_path=log,
        container=ContainerSpec(image="jetctl-code", docker_socket=socket),
    ))  # fmt: skip
    try:
        wait_for(lambda: not rt.poll(h).running, timeout_s=120, what="the probe")
        text = log.read_text()
        if socket:
            assert "RESULT docker 0 no net 42" in text, text
        else:
            assert "UNAVAILABLE no docker engine reachable" in text, text
    finally:
        rt.release(h)
    left = docker_client.containers.list(all=True, filters={"label": "jetctl.sandbox"})
    assert left == [], "the sandbox container is removed after its run"
