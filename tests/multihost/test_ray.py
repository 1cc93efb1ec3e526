"""runtime: ray on a Ray cluster of two nodes: the head (with the controller) and a worker, in
two network namespaces (tests/multihost/netns.py), Ray bound to their addresses only.

The task's client nodes ask for a custom resource only the worker has, so Ray places their
actors there (one placement group, a bundle per node); the server is an actor too. Training
runs; a node killed on the worker is restarted by the controller through Ray; a controller
killed with -9 leaves the actors running and `jetctl up --resume` adopts them; `jetctl
swap-clients --drop-old` starts the new revision's actors on the worker, drains the old and
removes their placement group, and training goes on; `jetctl down` drains the nodes and
removes the actors and placement groups. The ledger, built from what the controller
received, balances with no rollout left in progress, and the run's summary has the server's
steps and reward although its step log stayed on its Ray host.
"""

from __future__ import annotations

import json
import os
import signal
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from jetctl.run.ledger import build_ledger
from jetctl.run.status import finished_summary
from tests.multihost.netns import Hosts, need_netns
from tests.multihost.test_hosts import JETCTL, ROOT, StatusWatch, env, wait_for

# In CI's default tier (140 s in the fresh-clone CI of stop 36, the swap included). `jetctl status`
# is asked on the head, where the controller runs: there is no `ctl` host here.
pytestmark = [pytest.mark.integration, pytest.mark.multihost]

RAY_PORT = 6390
CONTROL_PORT = 7701

RECIPE = """
run:
  name: onray
  token: ray-test-token-0123456789
  control: {{host: 0.0.0.0, port: {control_port}}}
  ray:
    address: {head}:{ray_port}
    namespace: jetctl-test-{pid}
    work_dir: {work}
    runtime_env: {{env_vars: {{PYTHONPATH: "{root}"}}}}
  restart_backoff_s: 0.5
models:
  policy:
    model: builtin:tiny
    finetune: full
    optimizer: {{lr: 2.0e-3}}
    train: {{groups_per_step: 2, max_staleness: 8}}
    runtime: ray
    host: 0.0.0.0
    resources: {{cpus: 1}}
tasks:
  digits:
    env: envs.digits:make_env
    agent: agents.noisy:agent  # reward variance from the first group: steps at once
    model: policy
    clients: 2
    group_size: 4
    concurrency: 4
    runtime: ray
    resources: {{cpus: 0.5, custom: {{jetctl_worker: 1}}}}
    sampling: {{max_tokens: 4}}
"""

RAY_STATE = """
import json, sys, ray
ray.init(address=sys.argv[1], _node_ip_address=sys.argv[2], logging_level="ERROR")
ns = sys.argv[3]
actors = [a["name"] for a in ray.util.list_named_actors(all_namespaces=True)
          if a["namespace"] == ns]
groups = [g["name"] for g in ray.util.placement_group_table().values()
          if g["name"].startswith(ns + "/") and g["state"] != "REMOVED"]
print(json.dumps({"actors": sorted(actors), "groups": sorted(groups)}))
"""


@pytest.fixture
def cluster(tmp_path: Path) -> Iterator[Hosts]:
    """A Ray head on `head` and a worker (4 x jetctl_worker) on `worker`."""
    need_netns()
    if os.environ.get("CI") != "true":
        pytest.importorskip("ray", reason="pip install 'jetctl[ray]'")
    ray_bin = str(Path(sys.executable).with_name("ray"))
    short = Path(f"/tmp/jtr{os.getpid()}")  # Ray's socket paths must stay short
    with Hosts(["head", "worker"]) as hosts:
        head = hosts.addr("head")
        common = ["--block", "--disable-usage-stats", "--object-store-memory", "80000000"]
        ray_env = {**env(), "RAY_USAGE_STATS_ENABLED": "0"}
        hosts.spawn("head", [ray_bin, "start", "--head", f"--node-ip-address={head}",
                             f"--port={RAY_PORT}", "--num-cpus=2", "--include-dashboard=false",
                             f"--temp-dir={short}/h", *common],
                    log=tmp_path / "ray-head.log", env=ray_env)
        wait_for(lambda: hosts.run("head", [sys.executable, "-c", (
            f"import socket; socket.create_connection(('{head}', {RAY_PORT}), 2)")]
        ).returncode == 0, 120, "the Ray head")
        hosts.spawn("worker", [ray_bin, "start", f"--address={head}:{RAY_PORT}",
                               f"--node-ip-address={hosts.addr('worker')}", "--num-cpus=2",
                               '--resources={"jetctl_worker": 4}', f"--temp-dir={short}/w",
                               *common],
                    log=tmp_path / "ray-worker.log", env=ray_env)
        try:
            yield hosts
        finally:
            hosts.close()
            import shutil

            shutil.rmtree(short, ignore_errors=True)


def reporting(doc: dict[str, Any]) -> dict[str, int]:
    """Client node -> the pid it reported, of the nodes running that have synced with the
    controller (an actor the controller sees alive has no pid until its node reports)."""
    return {c["name"]: c["pid"] for c in doc["clients"]
            if c["state"] == "running" and c["pid"] is not None}


def ray_state(hosts: Hosts, namespace: str) -> dict[str, Any]:
    head = hosts.addr("head")
    res = hosts.run("head", [sys.executable, "-c", RAY_STATE, f"{head}:{RAY_PORT}", head,
                             namespace], env=env(), timeout=120)
    assert res.returncode == 0, res.stderr[-2000:]
    return dict(json.loads(res.stdout.strip().splitlines()[-1]))


@pytest.mark.timeout(600)
def test_client_actors_run_on_the_worker_and_the_run_cleans_up(
    cluster: Hosts, tmp_path: Path
) -> None:
    hosts = cluster
    run_dir = tmp_path / "run"
    recipe = tmp_path / "recipe.yaml"
    namespace = f"jetctl-test-{os.getpid()}"
    recipe.write_text(RECIPE.format(control_port=CONTROL_PORT, head=hosts.addr("head"),
                                    ray_port=RAY_PORT, pid=os.getpid(),
                                    work=tmp_path / "raywork", root=ROOT))
    up = [*JETCTL, "up", str(recipe), "--run-dir", str(run_dir)]
    controller = hosts.spawn("head", up, log=tmp_path / "up.log", env=env(), cwd=ROOT)
    watch = StatusWatch(hosts, run_dir, tmp_path / "status.log", host="head")
    try:
        doc = wait_for(
            lambda: (d := watch()) and (d["servers"][0]["version"] or 0) >= 2
            and len(reporting(d)) == 2 and d,
            300, "training on the Ray cluster",
        )
        addresses = {c["name"]: c["address"] for c in doc["clients"]}
        assert set(addresses.values()) == {hosts.addr("worker")}, addresses
        state = ray_state(hosts, namespace)
        assert state["actors"] == ["digits-0", "digits-1", "server-policy"], state
        assert state["groups"] == [f"{namespace}/digits/r0", f"{namespace}/server/policy"]

        # a node killed on the worker: the controller starts it again through Ray
        victim = next(c for c in doc["clients"] if c["name"] == "digits-0")
        os.kill(int(victim["pid"]), signal.SIGKILL)
        restarted = wait_for(
            lambda: (d := watch()) and any(
                c["name"] == "digits-0" and c["restarts"] == 1 and c["pid"] != victim["pid"]
                for c in d["clients"]) and len(reporting(d)) == 2 and d,
            120, "digits-0 restarted on Ray",
        )

        # the controller dies: the actors live on, a resumed controller adopts them
        before = reporting(restarted)
        controller.send_signal(signal.SIGKILL)
        controller.wait(timeout=30)
        assert ray_state(hosts, namespace)["actors"] == state["actors"]
        controller = hosts.spawn("head", [*up, "--resume"], log=tmp_path / "up2.log",
                                 env=env(), cwd=ROOT)
        watch.restart()  # nothing the killed controller said counts
        resumed = wait_for(
            lambda: (d := watch()) and len(reporting(d)) == 2 and d,
            180, "the adopted actors' nodes reporting to the resumed controller",
        )
        assert reporting(resumed) == before, "adopted, not restarted"

        # a swap through Ray: the new revision's actors first (on the worker, in a placement
        # group of their own), then the old ones drained and their group removed
        version_at_swap = int(resumed["servers"][0]["version"] or 0)
        swap = hosts.run("head", [*JETCTL, "swap-clients", "--task", "digits", "--agent",
                                  "agents.noisy:agent", "--drop-old", "--grace", "30",
                                  "--run-dir", str(run_dir)], env=env(), cwd=ROOT, timeout=300)
        assert swap.returncode == 0, swap.stdout + swap.stderr
        watch.restart()  # what it shows from here on was asked after the swap returned
        swapped = wait_for(
            lambda: (d := watch()) and sorted(reporting(d)) == [
                "digits-0-r1", "digits-1-r1"] and d,
            60, "the new revision's nodes reporting",
        )
        assert {c["address"] for c in swapped["clients"]} == {hosts.addr("worker")}
        assert {c["revision"] for c in swapped["clients"]} == {"r1"}
        after_swap = {
            "actors": ["digits-0-r1", "digits-1-r1", "server-policy"],
            "groups": [f"{namespace}/digits/r1", f"{namespace}/server/policy"],
        }
        deadline = time.monotonic() + 30  # Ray marks a removed group REMOVED soon after
        while (state := ray_state(hosts, namespace)) != after_swap and time.monotonic() < deadline:
            time.sleep(0.5)
        assert state == after_swap, f"the old actors and their placement group gone: {state}"
        trained = wait_for(
            lambda: (d := watch())
            and int(d["servers"][0]["version"] or 0) > version_at_swap and d,
            180, "training going on with r1",
        )

        watch.stop()
        down = hosts.run("head", [*JETCTL, "down", "--run-dir", str(run_dir)], env=env(),
                         cwd=ROOT, timeout=180)
        assert down.returncode == 0, down.stdout + down.stderr
        assert controller.wait(timeout=120) == 0
    finally:
        watch.stop()
        if controller.poll() is None:
            controller.kill()
    assert ray_state(hosts, namespace) == {"actors": [], "groups": []}, "down removed them"
    s = build_ledger(run_dir).summary()
    assert s["balanced"] and s["trained"] > 0 and s["awaiting_reports"] == 0, s
    assert s["in_flight"]["rollout"] == 0, "the drained nodes left no rollout in progress"
    assert {"digits-0", "digits-0-r1"} <= set(s["nodes"]), "both revisions' books"
    # what `jetctl up` printed at the end: the server's figures, heard over the network (its
    # step log stayed in its Ray host's work dir)
    summary = finished_summary(run_dir)["models"]["policy"]
    assert summary["steps"] >= int(trained["servers"][0]["version"]), summary
    assert summary["final_reward_source"] == "server status" and summary["final_reward"] is not None
    # the nodes' spools stayed in their Ray host's work dir, not in the run dir
    assert not (run_dir / "spool").exists()
    assert sorted(p.name for p in (tmp_path / "raywork" / namespace / "spool").glob("*.sqlite"))
