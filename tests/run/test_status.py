"""`jetctl status`: the JSON document, finding the run, and a dead controller's one-line error."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
from typer.testing import CliRunner

from jetctl.cli.main import build_app
from jetctl.proto._gen import control_pb2 as cpb
from jetctl.run.status import RunFinished, document, fetch_status, render_progress, render_status
from jetctl.rundir import (
    RecordError,
    RunDirError,
    find_run_dir,
    read_run_record,
    read_server_file,
    read_step_rows,
    update_latest_link,
    write_json_atomic,
)

pytestmark = pytest.mark.unit

SERVER_FIGURES = {
    "model": "policy", "model_version": "7", "buffer_groups": "3", "accepted_groups": "5",
    "accepted_trajectories": "40", "rejected": {"stale": "2", "invalid": "1"},
    "trained_trajectories": "32", "trained_groups": "4", "reward_mean_recent": 0.25,
    "trajectories_per_second": 1.5, "received_by_task": {"arith": "48"},
    "reward_by_task": {"arith": 0.625},
}
CLIENT_FIGURES = {
    "name": "arith-0", "task": "arith", "state": "draining", "revision": "r0",
    "rollouts_done": 12, "rollouts_failed": 1, "rollouts_timeout": 0, "spool_depth": 2,
    "server_reachable": False,
}


def reply() -> cpb.RunStatusReply:
    return cpb.RunStatusReply(
        run="t", run_dir="/runs/t", uptime_s=12.5, state="running",
        nodes=[
            cpb.NodeStatus(name="server-policy", kind="server", model="policy", state="running",
                           pid=10, restarts=1, endpoint="127.0.0.1:5", json=json.dumps(SERVER_FIGURES)),
            cpb.NodeStatus(name="arith-0", kind="client", task="arith", model="policy",
                           state="running", pid=11, revision="r0", json=json.dumps(CLIENT_FIGURES)),
            cpb.NodeStatus(name="arith-1", kind="client", task="arith", model="policy",
                           state="restarting", restarts=2, revision="r0", json="{}"),
        ],
    )


def test_document_shape_and_types() -> None:
    doc = document(reply())
    assert set(doc) == {"run", "run_dir", "state", "uptime_s", "servers", "clients", "tasks"}
    assert doc["tasks"] == {"arith": {"models": ["policy"], "roles": {}, "revisions": ["r0"],
                                      "nodes": 2, "up": 1, "rollouts_done": 12,
                                      "spool_depth": 2, "received": 48, "reward": 0.625,
                                      "reward_by_model": {"policy": 0.625},
                                      "staleness": None, "staleness_by_model": {},
                                      "batch_share": None, "starving": False}}
    (s,) = doc["servers"]
    assert s["version"] == 7 and s["buffer_depth"] == 3 and s["accepted"] == 40
    assert s["rejected"] == {"stale": 2, "invalid": 1} and s["trained"] == 32
    assert s["restarts"] == 1 and s["reward_mean"] == 0.25
    c0, c1 = doc["clients"]
    assert c0["state"] == "draining" and c0["process_state"] == "running"  # the node's own word
    assert c0["rollouts_done"] == 12 and c0["spool_depth"] == 2 and c0["server_reachable"] is False
    assert c1["state"] == "restarting" and c1["rollouts_done"] is None and c1["restarts"] == 2
    json.dumps(doc)  # serialisable
    render_status(doc)
    from rich.console import Console

    console = Console(width=120, record=True)
    console.print(render_status(doc))
    assert "0.625" in console.export_text(), "the tasks table shows each task's reward"


def _team_document(server_figures: dict[str, dict[str, object]]) -> dict:
    """The status document of a run with one server per model (its figures on top of
    SERVER_FIGURES) and one client node of task "team" whose roles are planner: big and
    coder: small."""
    servers = [
        cpb.NodeStatus(name=f"server-{m}", kind="server", model=m, state="running",
                       json=json.dumps({**SERVER_FIGURES, "model": m, **extra}))
        for m, extra in server_figures.items()
    ]
    client = {**CLIENT_FIGURES, "name": "team-0", "task": "team", "models": ["big", "small"],
              "roles": {"planner": "big", "coder": "small"}}
    return document(cpb.RunStatusReply(
        run="t", run_dir="/runs/t", state="running",
        nodes=[*servers, cpb.NodeStatus(name="team-0", kind="client", task="team", model="big",
                                        state="running", revision="r0",
                                        json=json.dumps(client))],
    ))

def test_a_team_task_shows_its_roles_models_and_each_roles_reward() -> None:
    figures = {"big": 0.75, "small": 0.25}
    doc = _team_document({m: {"received_by_task": {"team": "16"}, "reward_by_task": {"team": r}}
                          for m, r in figures.items()})
    team = doc["tasks"]["team"]
    assert team["models"] == ["big", "small"] and team["roles"] == {"planner": "big", "coder": "small"}
    assert team["received"] == 32 and team["reward_by_model"] == figures
    assert team["reward"] == 0.5
    from rich.console import Console

    console = Console(width=160, record=True)
    console.print(render_status(doc))
    text = console.export_text()
    assert "planner:big, coder:small" in text and "planner 0.750 coder 0.250" in text
    # `jetctl up` draws the same row from the recipe's roles
    from jetctl.recipe import parse_recipe

    recipe = parse_recipe(
        "run: {name: t}\nmodels:\n  big: {model: builtin:tiny}\n  small: {model: builtin:tiny}\n"
        "tasks:\n  team:\n    env: envs.digits.team:make_env\n"
        "    agent: agents.digits:team_agent\n    roles: {planner: big, coder: small}\n", env={})
    console = Console(width=160, record=True)
    console.print(render_progress(doc, recipe))
    text = console.export_text()
    assert "planner:big, coder:small" in text and "planner 0.750 coder 0.250" in text


def test_find_run_dir_prefers_latest_then_newest(tmp_path: Path) -> None:
    runs = tmp_path / "runs"
    with pytest.raises(RunDirError, match="jetctl up"):
        find_run_dir(None, runs)
    for name in ("a", "b"):
        write_json_atomic(runs / name / "run.json", {"run": name})
    os.utime(runs / "a" / "run.json", (1, 1))
    assert find_run_dir(None, runs) == (runs / "b").resolve()
    update_latest_link(runs / "latest", runs / "a")
    assert find_run_dir(None, runs) == (runs / "a").resolve()
    assert os.readlink(runs / "latest") == "a"


def test_dead_controller_is_one_line_not_a_traceback(tmp_path: Path) -> None:
    rd = tmp_path / "runs" / "t"
    info = {"run": "t", "recipe": "/r.yaml", "run_dir": str(rd), "state": "running",
            "controller": {"pid": 2**22 + 12345, "endpoint": "127.0.0.1:1"}}
    write_json_atomic(rd / "run.json", info)
    with pytest.raises(RunDirError, match="not running"):
        fetch_status(rd)
    res = CliRunner().invoke(build_app(), ["status", "--run-dir", str(rd), "--once", "--json"])
    assert res.exit_code == 1
    assert "not running" in res.output and "Traceback" not in res.output
    write_json_atomic(rd / "run.json", {**info, "state": "finished"})
    with pytest.raises(RunFinished):
        fetch_status(rd)


def test_up_and_status_draw_the_same_tables_in_one_vocabulary() -> None:
    from rich.console import Console

    from jetctl.recipe import parse_recipe

    recipe = parse_recipe(
        "run: {name: t, duration_s: 60}\n"
        "models:\n  policy: {model: builtin:tiny, train: {max_steps: 50}}\n"
        "tasks:\n  arith:\n    env: envs.arithmetic:make_env\n    agent: agents.arithmetic:agent\n"
        "    model: policy\n    clients: 2\n", env={})
    doc = document(reply())
    texts = []
    for view in (render_status(doc), render_progress(doc, recipe)):
        console = Console(width=160, record=True)
        console.print(view)
        texts.append(console.export_text())
    up_text = texts[1]
    models_header = ("model", "state", "version", "reward", "traj/s", "accepted", "trained",
                     "buffered", "rejected", "restarts")
    tasks_header = ("task", "model", "rev", "clients up", "rollouts", "failed", "received",
                    "reward")
    for text in texts:
        lines = [line.strip() for line in text.splitlines()]
        assert "models" in lines and "tasks" in lines
        assert any(all(col in line for col in models_header) for line in lines), text
        assert any(all(col in line for col in tasks_header) for line in lines), text
        assert "version = optimizer steps" in text and "trajectories" in text
        assert "servers" not in lines  # one name for a model's server in both views
    assert "7/50" in up_text  # version toward max_steps
    # accepted 40, trained 32 trajectories: 8 buffered, in the same unit
    assert doc["servers"][0]["buffered"] == 8


def test_a_starting_server_shows_what_it_is_doing() -> None:
    import time

    from rich.console import Console

    phase = {"phase": "preparing builtin:smollm2-135m-instruct: dequantizing the gguf weights",
             "phase_since": time.time() - 12}
    starting = cpb.RunStatusReply(run="t", run_dir="/runs/t", uptime_s=14.0, state="starting",
                                  nodes=[cpb.NodeStatus(name="server-policy", kind="server",
                                                        model="policy", state="starting",
                                                        json=json.dumps(phase))])
    doc = document(starting)
    assert doc["servers"][0]["phase"] == phase["phase"]
    console = Console(width=200, record=True)
    console.print(render_status(doc))
    text = console.export_text()
    assert "starting: preparing builtin:smollm2-135m-instruct: dequantizing the gguf" in text
    assert "0m12s" in text or "0m13s" in text


def finished_run(tmp_path: Path) -> Path:
    """A run dir as a finished run leaves it: run.json, a steps log, checkpoints, a curve."""
    from jetctl.controller.plot import write_reward_curve

    rd = tmp_path / "runs" / "t"
    recipe = tmp_path / "r.yaml"
    recipe.write_text(
        "run: {name: t}\nmodels:\n  policy: {model: builtin:tiny}\n"
        "tasks:\n  arith:\n    env: envs.arithmetic:make_env\n"
        "    agent: agents.arithmetic:agent\n    model: policy\n")
    write_json_atomic(rd / "run.json", {
        "run": "t", "recipe": str(recipe), "run_dir": str(rd), "state": "finished",
        "controller": {"pid": 2**22 + 12345, "endpoint": "127.0.0.1:1"},
        "servers": {"policy": {"endpoint": "127.0.0.1:2", "pid": None}},
        "started_at": 1000.0, "finished_at": 1930.0, "stop_reason": "duration_s (900s) elapsed",
    })
    (rd / "metrics").mkdir(parents=True)
    with open(rd / "metrics" / "policy.steps.jsonl", "w") as f:
        f.writelines(json.dumps({"step": i, "stepped": 1, "time": 1000.0 + 40 * i,
                                "reward/mean": i / 20}) + "\n" for i in range(1, 21))
    for name in ("step-00000010", "step-00000020", "step-00000030.partial"):
        (rd / "checkpoints" / "policy" / name).mkdir(parents=True)
    for name in ("step-00000010", "step-00000020"):
        (rd / "checkpoints" / "policy" / name / "manifest.json").write_text("{}")
    write_reward_curve(rd)
    return rd


def test_status_of_a_finished_run_is_its_summary(tmp_path: Path) -> None:
    rd = finished_run(tmp_path)
    res = CliRunner().invoke(build_app(), ["status", "--run-dir", str(rd), "--once", "--json"])
    assert res.exit_code == 0, res.output
    summary = json.loads(res.output)
    assert summary["state"] == "finished" and summary["stop_reason"].startswith("duration_s")
    assert summary["duration_s"] == 930.0
    policy = summary["models"]["policy"]
    assert policy["steps"] == 20 and policy["batches"] == 20
    assert policy["final_reward"] == pytest.approx(sum(i / 20 for i in range(11, 21)) / 10)
    assert policy["last_checkpoint"] == str(rd / "checkpoints" / "policy" / "step-00000020")
    assert summary["ledger"]["balanced"] is True
    assert summary["reward_curve"] == str(rd / "reward_curve.png")

    res = CliRunner().invoke(build_app(), ["status", "--run-dir", str(rd)], env={"COLUMNS": "200"})
    assert res.exit_code == 0, res.output
    for shown in ("finished", "duration_s (900s) elapsed", "ran 15m30s", "0.775",
                  "step-00000020", "balanced", "reward_curve.png"):
        assert shown in res.output, (shown, res.output)


def test_the_summary_of_a_server_on_another_host_has_what_the_controller_heard(
    tmp_path: Path,
) -> None:
    """A server hosted by Ray, or run by the user on another host, keeps its step log and its
    checkpoints on its own host: the summary takes its steps (the larger of its last Status
    and its last sync, sent as it exits), its recent reward and its last checkpoint from
    what the controller heard over the network and wrote into run.json."""
    from rich.console import Console

    from jetctl.controller.state import Node, Report, RunState
    from jetctl.recipe import load_recipe
    from jetctl.run.status import finished_summary, render_summary
    from jetctl.rundir import RunPaths

    recipe = tmp_path / "r.yaml"
    recipe.write_text(
        "run: {name: t}\nmodels:\n  policy: {model: builtin:tiny, runtime: external}\n"
        "tasks:\n  arith:\n    env: envs.arithmetic:make_env\n"
        "    agent: agents.arithmetic:agent\n    model: policy\n")
    rd = tmp_path / "runs" / "t"
    state = RunState(load_recipe(str(recipe)), recipe, RunPaths(rd))
    state.nodes["server-policy"] = Node(name="server-policy", kind="server", model="policy",
                                        runtime="external", endpoint="10.0.0.2:7000")
    state.server_status["policy"] = {**SERVER_FIGURES, "last_checkpoint_version": "5"}
    # its last sync, as it exited after one more step than the last Status the probe saw
    state.reports["server-policy"] = Report(status={"state": "exited", "version": 8},
                                            received_at=0.0, kind="server", final=True)
    state.phase, state.finished_at = "finished", state.started_at + 60
    state.write_run_json()
    assert not RunPaths(rd).metrics.exists(), "no step log in the controller's run dir"

    policy = finished_summary(rd)["models"]["policy"]
    assert policy["steps"] == 8
    assert policy["final_reward"] == 0.25 and policy["final_reward_source"] == "server status"
    assert policy["last_checkpoint"] == "step 5, on the server's host"
    console = Console(width=200, record=True)
    console.print(render_summary(finished_summary(rd)))
    text = console.export_text()
    row = next(line for line in text.splitlines() if line.strip().startswith("policy"))
    assert row.split()[1:3] == ["8", "0.250"], row
    assert "policy: of its server's recent trajectories" in text


def test_a_mixed_tasks_share_of_the_batches_and_starving_are_shown() -> None:
    """train.mix: the server reports each task's share of its recent batches and the tasks
    its batches wait for; the tasks table shows both."""
    figures = {**SERVER_FIGURES, "received_by_task": {"web": "30", "api": "10"},
               "batch_share_by_task": {"web": 0.5, "api": 0.5}, "starving_tasks": ["api"]}
    doc = document(cpb.RunStatusReply(
        run="t", run_dir="/runs/t", state="running",
        nodes=[cpb.NodeStatus(name="server-policy", kind="server", model="policy",
                              state="running", json=json.dumps(figures))],
    ))
    assert doc["tasks"]["api"]["batch_share"] == 0.5 and doc["tasks"]["api"]["starving"]
    assert doc["tasks"]["web"]["batch_share"] == 0.5 and not doc["tasks"]["web"]["starving"]
    from rich.console import Console

    console = Console(width=160, record=True)
    console.print(render_status(doc))
    rows = {line.split()[0]: line for line in console.export_text().splitlines() if line.strip()}
    assert "0.50 starving" in rows["api"] and "0.50" in rows["web"]
    assert "starving" not in rows["web"]


def test_each_tasks_staleness_is_shown_per_role() -> None:
    """Status.staleness_by_task of each server: the tasks table shows a task's staleness in
    versions, a team's per role; the document keeps each model's and the largest."""
    lags = {"big": {"team": 0.5, "solo": 2.5}, "small": {"team": 3.0}}
    doc = _team_document({m: {"staleness_by_task": by_task} for m, by_task in lags.items()})
    team, solo = doc["tasks"]["team"], doc["tasks"]["solo"]
    assert team["staleness_by_model"] == {"big": 0.5, "small": 3.0} and team["staleness"] == 3.0
    assert solo["staleness_by_model"] == {"big": 2.5} and solo["staleness"] == 2.5
    assert doc["tasks"]["arith"]["staleness"] is None
    from rich.console import Console

    console = Console(width=200, record=True)
    console.print(render_status(doc))
    rows = {line.split()[0]: line for line in console.export_text().splitlines() if line.strip()}
    assert "planner 0.5 coder 3.0" in rows["team"] and "2.5" in rows["solo"]


def test_the_ledger_line_says_balanced_first_so_a_narrow_terminal_wraps_the_counts() -> None:
    from rich.console import Console

    from jetctl.run.status import ledger_line

    ledger = {"produced": 123456, "trained": 123000, "rejected": {"stale": 400},
              "dropped": {"timeout": 48}, "in_flight": {"spool": 8}, "balanced": True,
              "lost": 0, "trained_twice": 0, "conflicts": 0}
    console = Console(width=60, record=True)
    console.print(ledger_line(ledger))
    first = console.export_text().splitlines()[0]
    assert first.startswith("ledger  balanced: produced 123456"), first
    quickstart = {**ledger, "produced": 3000, "trained": 2944, "rejected": {"stale": 56},
                  "dropped": {}, "in_flight": {}}
    console = Console(width=80, record=True)
    console.print(ledger_line(quickstart))
    assert console.export_text() == (
        "ledger  balanced: produced 3000, trained 2944, rejected 56\n"), "one line, no zeros"
    console = Console(width=200, record=True)
    console.print(ledger_line({**ledger, "balanced": False, "lost": 3}))
    assert "ledger  NOT balanced: lost 3, trained twice 0, conflicts 0: produced" in \
        console.export_text()


def test_run_json_reads_as_a_typed_record_and_a_missing_field_names_the_file(
    tmp_path: Path,
) -> None:
    rd = tmp_path / "runs" / "t"
    info = {"run": "t", "recipe": "/r.yaml", "run_dir": str(rd), "state": "running",
            "controller": {"pid": 2**22 + 12345, "endpoint": "127.0.0.1:1", "create_time": 5.5},
            "servers": {"policy": {"endpoint": "127.0.0.1:2", "pid": 7,
                                   "trained": {"version": 9, "reward_mean_recent": 0.5,
                                               "trained_groups": 4,
                                               "last_checkpoint_version": 8}},
                        "critic": {"endpoint": "", "pid": None, "trained": {}}},
            "clients": {"arith-0": {"task": "arith", "revision": "r0", "pid": 11},
                        "web-0": {"task": "web", "revision": "r1", "container_id": "c0ffee"}},
            "tls": {"mode": "mtls", "cert_dir": "/certs"}, "started_at": 1000.0}
    write_json_atomic(rd / "run.json", info)
    run = read_run_record(rd)
    assert (run.run, run.recipe, run.state, run.started_at, run.finished_at) == (
        "t", "/r.yaml", "running", 1000.0, None)
    assert run.controller is not None and (run.controller.pid, run.controller.endpoint,
                                           run.controller.create_time) == (
        2**22 + 12345, "127.0.0.1:1", 5.5)
    assert run.trained["policy"].version == 9 and run.trained["policy"].trained_groups == 4
    assert run.trained["critic"].version is None  # the controller heard nothing yet
    assert run.clients["arith-0"].pid == 11 and run.clients["web-0"].pid is None
    assert run.tls == {"mode": "mtls", "cert_dir": "/certs"}

    for broken, field in (({k: v for k, v in info.items() if k != "recipe"}, "'recipe'"),
                          ({**info, "controller": {"pid": 3}}, "'endpoint'"),
                          ({**info, "controller": {"pid": "three", "endpoint": "h:1"}},
                           "'pid' is 'three'")):
        write_json_atomic(rd / "run.json", broken)
        with pytest.raises(RecordError, match=field) as e:
            read_run_record(rd)
        assert str(rd / "run.json") in str(e.value)
    # `jetctl status` says so in one line
    write_json_atomic(rd / "run.json", {k: v for k, v in info.items() if k != "recipe"})
    res = CliRunner().invoke(build_app(), ["status", "--run-dir", str(rd), "--once", "--json"])
    assert res.exit_code == 1 and "Traceback" not in res.output
    assert "run.json has no 'recipe'" in " ".join(res.output.split())


def test_step_rows_are_typed_up_to_the_last_whole_line(tmp_path: Path) -> None:
    log = tmp_path / "metrics" / "policy.steps.jsonl"
    assert read_step_rows(log) == []  # no log yet
    row = {"step": 3.0, "stepped": 1.0, "time": 1000.0, "reward/mean": 0.25, "groups": 2.0,
           "trajectories": 16.0, "groups/skipped": 1.0, "trajectories/skipped": 8.0,
           "cost/usd": 0.5}
    log.parent.mkdir()
    log.write_text(json.dumps(row) + "\n" + json.dumps({**row, "stepped": 0.0}) + "\n"
                   + json.dumps(row)[:20])  # the third row is being written
    first, second = read_step_rows(log)
    assert (first.step, first.stepped, first.reward_mean, first.groups, first.trajectories,
            first.groups_skipped, first.trajectories_skipped) == (3, True, 0.25, 2, 16, 1, 8)
    assert second.stepped is False
    assert first["cost/usd"] == 0.5 and "cost/usd" in first and "eval/rows/step" not in first
    with open(log, "a") as f:
        f.write("\n" + json.dumps({k: v for k, v in row.items() if k != "reward/mean"}) + "\n")
    with pytest.raises(RecordError, match="line 3 is not JSON"):
        read_step_rows(log)
    log.write_text(json.dumps({k: v for k, v in row.items() if k != "reward/mean"}) + "\n")
    with pytest.raises(RecordError, match=r"policy.steps.jsonl line 1 has no 'reward/mean'"):
        read_step_rows(log)


def test_a_servers_file_reads_typed_and_a_missing_one_says_the_server_is_not_serving(
    tmp_path: Path,
) -> None:
    with pytest.raises(RecordError, match=r"servers/policy.json is missing: policy's server"):
        read_server_file(tmp_path, "policy")
    write_json_atomic(tmp_path / "servers" / "policy.json", {
        "model": "policy", "endpoint": "127.0.0.1:5", "metrics": "127.0.0.1:6", "pid": 42,
        "version": 3, "refused_revisions": []})
    server = read_server_file(tmp_path, "policy")
    assert (server.endpoint, server.metrics, server.pid, server.version) == (
        "127.0.0.1:5", "127.0.0.1:6", 42, 3)
