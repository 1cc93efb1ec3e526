"""A rolling swap in the middle of real training (tiny model, digits task), on the process
runtime and on docker: the model version keeps rising through the swap, the new revision's
trajectories reach the server's store, no old node or container is left, and every group
the clients made is accounted for (acked and stored, or still spooled: nothing lost).
"""

from __future__ import annotations

import json
import sqlite3
import threading
from pathlib import Path
from typing import Any

import pytest

from jetctl.controller.controller import Controller, ControllerOptions
from tests.controller.controller_fakes import Running, node_states, wait_for, write_recipe
from tests.controller.docker_support import BASE_IMAGE, containers_of, docker_or_skip

SWAP_TAG = "jetctl-base:swap-training"


def recipe(runtime: str) -> dict[str, Any]:
    task: dict[str, Any] = {
        "env": "envs.digits:make_env",
        # a plumbing test: the noisy agent gives every group reward variance, so steps (and
        # versions) come from the first batch on, whatever the random tiny model writes
        "agent": "agents.noisy:agent",
        "model": "policy",
        "clients": 1,
        "group_size": 8,
        "concurrency": 8,
        "sampling": {"max_tokens": 4},
        "runtime": runtime,
    }
    if runtime == "docker":
        task.update(image=BASE_IMAGE, resources={"cpus": 1.0, "memory": "2g", "pids": 256})
    return {
        "run": {"name": f"swap-{runtime}", "restart_backoff_s": 0.5, "duration_s": 600},
        "models": {
            "policy": {
                "model": "builtin:tiny",
                "finetune": "full",
                "optimizer": {"lr": 3.0e-3},
                "train": {"groups_per_step": 1, "max_staleness": 4},
                "checkpoint": {"every_steps": 1000},
            }
        },
        "tasks": {"digits": task},
    }


def version(ctl: Controller) -> int:
    for n in ctl.status().nodes:
        if n.kind == "server":
            return int(json.loads(n.json or "{}").get("model_version") or 0)
    return 0


@pytest.mark.parametrize(
    "runtime",
    [
        pytest.param("process", marks=[pytest.mark.integration, pytest.mark.timeout(1200)]),
        pytest.param("docker", marks=[pytest.mark.docker, pytest.mark.timeout(1200)]),
    ],
)
def test_swap_during_training_loses_nothing(runtime: str, tmp_path: Path) -> None:
    client = docker_or_skip() if runtime == "docker" else None
    run_dir = tmp_path / "run"
    rec, path = write_recipe(tmp_path, recipe(runtime))
    ctl = Controller(
        rec, path, run_dir=run_dir, options=ControllerOptions(tick_s=0.2, grace_s=30.0, probe_s=0.3)
    )
    r = Running(ctl).start()
    seen: list[int] = []
    sampling = threading.Event()

    def sample() -> None:
        while not sampling.wait(0.3):
            seen.append(version(ctl))

    sampler = threading.Thread(target=sample, daemon=True)
    sampler.start()
    try:
        wait_for(lambda: version(ctl) >= 1, timeout_s=480, what="training to start")
        if runtime == "docker":
            client.images.get(BASE_IMAGE).tag(*SWAP_TAG.split(":"))
            result = ctl.swap_clients("digits", image=SWAP_TAG, grace_s=30)
        else:
            result = ctl.swap_clients("digits", agent="agents.noisy:agent", grace_s=30)
        at_swap = version(ctl)
        assert result.ok, result.message
        assert "un-acked" not in result.message, result.message
        wait_for(lambda: version(ctl) >= at_swap + 1, timeout_s=480, what="training after the swap")

        assert set(node_states(ctl)) == {"server-policy", "digits-0-r1"}, "the old node is gone"
        if client is not None:
            live = containers_of(client, run_dir)
            assert [c.labels["jetctl.revision"] for c in live] == ["r1"], "no old container"
    finally:
        sampling.set()
        r.stop(grace_s=30)
        if client is not None:
            client.images.remove(SWAP_TAG)

    assert seen == sorted(seen) and seen[-1] > seen[0], "the version kept rising through the swap"
    if client is not None:
        assert containers_of(client, run_dir) == []
    db = sqlite3.connect(run_dir / "server-policy" / "store.sqlite")
    stored = dict(
        db.execute(
            "SELECT revisions, COUNT(*) FROM groups WHERE state != 'rejected' GROUP BY revisions"
        ).fetchall()
    )
    assert stored.get("r0", 0) > 0 and stored.get("r1", 0) > 0, stored

    # nothing lost: every group each node spooled was acked (and the server holds it) or
    # is still in that node's spool; the server stored exactly what the clients saw acked
    nodes = {p.stem: json.loads(p.read_text()) for p in (run_dir / "nodes").glob("*.json")}
    assert set(nodes) == {"digits-0", "digits-0-r1"}
    assert nodes["digits-0"]["spool_depth"] == 0, "the old node flushed its spool on drain"
    acked: dict[str, int] = {}
    for name, node in nodes.items():
        assert node["groups_spooled"] == sum(node["acks"].values()) + node["spool_depth"], name
        for code, n in node["acks"].items():
            acked[code] = acked.get(code, 0) + n
    rows = dict(db.execute("SELECT state = 'rejected', COUNT(*) FROM groups GROUP BY 1").fetchall())
    # a DUPLICATE ack is a group stored by an earlier try whose ACCEPTED ack got lost
    assert acked.get("accepted", 0) + acked.get("duplicate", 0) == rows.get(0, 0)
    assert acked.get("stale", 0) == rows.get(1, 0)
