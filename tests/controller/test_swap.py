"""Rolling client swaps with fake nodes (process runtime): order, names, refusal, resume.

The real thing, with a training server and real clients, is in test_swap_training.py.
"""

from __future__ import annotations

import json
import threading
from pathlib import Path

import pytest

from jetctl.controller.controller import Controller
from tests.controller.controller_fakes import (
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

pytestmark = [pytest.mark.integration, pytest.mark.timeout(90)]


def test_swap_starts_the_new_revision_before_draining_the_old(
    make_controller, run_dir: Path
) -> None:
    r = make_controller(recipe_dict(clients=2)).start()
    wait_for(r.all_running, what="every node running")
    versions = [r.ctl.status().nodes[0].json]

    result = r.ctl.swap_clients("arith", agent="agents.other:agent", grace_s=5.0)

    assert result.ok, result.message
    assert result.revision == "r1"
    states = node_states(r.ctl)
    assert set(states) == {"server-policy", "arith-0-r1", "arith-1-r1"}, states
    assert all(s == "running" for s in states.values())
    ev = events(run_dir)
    new_up = max(t for t, name, what, _ in ev if name.endswith("-r1") and what == "start")
    old_term = min(
        t for t, name, what, _ in ev if name in ("arith-0", "arith-1") and what == "sigterm"
    )
    assert new_up < old_term, "the old nodes drain only after the new ones started"
    assert {name for _, name, what, _ in ev if what == "exit"} >= {"arith-0", "arith-1"}
    # the new nodes run the new agent, under their own names and revision
    node = json.loads((run_dir / "nodes" / "arith-0-r1.json").read_text())
    assert node["agent"] == "agents.other:agent" and node["revision"] == "r1"
    info = wait_for(
        lambda: (d := read_run_json(run_dir)) and "arith-0" not in d["clients"] and d,
        what="run.json without the old nodes",
    )
    assert info["tasks"]["arith"] == {
        "revision": "r1",
        "agent": "agents.other:agent",
        "image": None,
    }
    assert {c["revision"] for c in info["clients"].values()} == {"r1"}
    assert versions  # the server kept serving throughout (it was never restarted)
    assert r.ctl.status().nodes[0].restarts == 0


def test_drop_old_tells_the_server_to_refuse_the_old_revision(
    make_controller, run_dir: Path
) -> None:
    r = make_controller(recipe_dict(clients=1)).start()
    wait_for(r.all_running, what="every node running")
    first = r.ctl.swap_clients("arith", agent="agents.a:agent", drop_old=True)
    second = r.ctl.swap_clients("arith", agent="agents.b:agent", drop_old=True)

    assert first.ok and second.ok, (first.message, second.message)
    assert second.revision == "r2"
    refused = read_run_json(run_dir)["refused"]["policy"]
    assert refused == ["arith/r0", "arith/r1"]  # task-qualified: other tasks' r0 still count
    echoed = r.ctl.state.reports["server-policy"].refused
    assert sorted(echoed) == refused, "the server confirms (in its sync) what it refuses"
    assert "refused by the server" in second.message


def test_swap_refusals_say_what_to_do(make_controller, run_dir: Path) -> None:
    r = make_controller(recipe_dict(clients=1)).start()
    wait_for(r.all_running, what="every node running")

    assert "not in the recipe" in r.ctl.swap_clients("nope", agent="a:b").message
    assert "--image needs runtime: docker" in r.ctl.swap_clients("arith", image="x").message
    assert "module:function" in r.ctl.swap_clients("arith", agent="not-an-entry").message
    assert "--agent" in r.ctl.swap_clients("arith").message
    assert node_states(r.ctl).keys() == {"server-policy", "arith-0"}, "nothing changed"


def test_a_new_revision_that_never_comes_up_is_rolled_back(
    make_controller, run_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # the new node ignores nothing but never reports running: its name is not the one it
    # syncs under (fake clients join as --name, else <task>-<index>; hide --name)
    r = make_controller(recipe_dict(clients=1)).start()
    wait_for(r.all_running, what="every node running")
    real = r.ctl.reconciler.commands

    class NoName:
        def server(self, model: str, port: int, metrics_port: int | None) -> list[str]:
            return real.server(model, port, metrics_port)

        def client(
            self,
            task: str,
            index: int,
            revision: str,
            name: str | None = None,
            agent: str | None = None,
        ) -> list[str]:
            return real.client(task, index, revision, None, agent)

    monkeypatch.setattr(r.ctl.reconciler, "commands", NoName())
    result = r.ctl.swap_clients("arith", agent="agents.x:agent", healthy_timeout_s=2.0)

    assert not result.ok and "did not report running" in result.message
    assert node_states(r.ctl) == {"server-policy": "running", "arith-0": "running"}
    assert read_run_json(run_dir)["tasks"]["arith"]["revision"] == "r0"


def test_resume_keeps_the_swapped_revision(tmp_path: Path, run_dir: Path) -> None:
    recipe, path = write_recipe(tmp_path, recipe_dict(clients=1))
    first = Controller(
        recipe, path, run_dir=run_dir, commands=fake_commands(path, run_dir), options=FAST
    )
    r = Running(first).start()
    wait_for(r.all_running, what="every node running")
    assert first.swap_clients("arith", agent="agents.v2:agent").ok

    # the controller dies (its nodes keep running): it stops without its drain
    def die() -> None:
        first._done.set()
        if first._grpc is not None:
            first._grpc.stop(0)

    first._teardown = die  # type: ignore[method-assign]
    first._stop.set()
    r.thread.join(timeout=30)
    assert not r.thread.is_alive()

    second = Controller(
        recipe,
        path,
        run_dir=run_dir,
        commands=fake_commands(path, run_dir),
        options=FAST,
        resume=True,
    )
    r2 = Running(second).start()
    try:
        assert set(node_states(second)) == {"server-policy", "arith-0-r1"}
        wait_for(r2.all_running, what="adopted nodes running")
        assert second.swap_clients("arith", agent="agents.v3:agent").revision == "r2"
    finally:
        r2.stop(grace_s=3.0)


def test_concurrent_swaps_of_one_task_are_refused(make_controller, run_dir: Path) -> None:
    r = make_controller(recipe_dict(clients=1)).start()
    wait_for(r.all_running, what="every node running")
    results: list[str] = []
    t = threading.Thread(
        target=lambda: results.append(r.ctl.swap_clients("arith", agent="a.b:c").message)
    )
    t.start()
    wait_for(lambda: "arith" in r.ctl.swapper.swapping, what="the first swap to begin")
    second = r.ctl.swap_clients("arith", agent="a.b:d")
    t.join(timeout=30)
    assert not second.ok and "already in progress" in second.message
    assert results and "r1 running" in results[0]


def test_the_cli_swaps_and_reports_the_new_revision(make_controller, run_dir: Path) -> None:
    from typer.testing import CliRunner

    from jetctl.cli.main import build_app

    r = make_controller(recipe_dict(clients=1)).start()
    wait_for(r.all_running, what="every node running")
    app = build_app()
    res = CliRunner().invoke(
        app,
        [
            "swap-clients",
            "--task",
            "arith",
            "--agent",
            "agents.v2:agent",
            "--grace",
            "5",
            "--run-dir",
            str(run_dir),
        ],
    )
    assert res.exit_code == 0, res.output
    assert "swapped to revision r1" in res.output
    res = CliRunner().invoke(
        app, ["swap-clients", "--task", "arith", "--image", "x", "--run-dir", str(run_dir)]
    )
    assert res.exit_code == 1 and "--image needs runtime: docker" in res.output
