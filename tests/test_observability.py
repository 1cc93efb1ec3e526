"""A short real run of builtin:tiny (`jetctl up --detach`) with `run.trackers: [tensorboard]`:
`jetctl logs` merges every process's lines and `-f` follows the live run, TensorBoard's
event files hold the same reward series as the step log (jetctl.logs, jetctl.trackers), and
every metric the Grafana dashboard (docs/grafana/jetctl.json) queries is on the live
processes' /metrics."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
import urllib.request
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

from jetctl.rundir import RunPaths, read_json, read_server_file
from tests.runs import ROOT, detached_run, jetctl, step_rows
from tests.test_grafana import exported_metrics, queried_metrics

pytestmark = [pytest.mark.integration, pytest.mark.timeout(600)]

RECIPE = """
run:
  name: obs
  duration_s: 600
  trackers: [tensorboard]
models:
  policy:
    model: builtin:tiny
    finetune: full
    optimizer: {lr: 2.0e-3}
    train: {groups_per_step: 2, max_staleness: 2}  # runs until the test downs it
tasks:
  digits:
    env: envs.digits:make_env
    agent: agents.digits:agent
    model: policy
    clients: 1
    group_size: 8
    sampling: {max_tokens: 4}
"""


@dataclass(frozen=True)
class Run:
    dir: Path
    followed: list[str]  # what `jetctl logs -f --server policy --grep draining` printed
    metrics: str  # the server's and the client node's /metrics pages, while live


def scrape(rd: Path) -> str:
    """/metrics of every server and client node of the live run."""
    paths = RunPaths(rd)
    servers = [read_server_file(rd, p.stem).metrics for p in paths.servers.glob("*.json")]
    # a node's file is its last synced status (free-form: no typed reader)
    nodes = [(read_json(p) or {}).get("metrics") for p in paths.nodes.glob("*.json")]
    found = [m for m in (*servers, *nodes) if m]
    pages = [urllib.request.urlopen(f"http://{m}/metrics", timeout=10).read().decode()
             for m in found]
    assert len(pages) == 2, found  # the server and the one client node
    return "".join(pages)


@pytest.fixture(scope="module")
def run(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Run]:
    """Up, 3 optimizer steps, then `jetctl down` while `jetctl logs -f` follows: the server's
    drain line is written only after the follower started, so seeing it means following."""
    tmp = tmp_path_factory.mktemp("obs")
    (tmp / "obs.yaml").write_text(RECIPE)
    with detached_run(tmp / "obs.yaml", tmp / "run") as rd:
        deadline = time.monotonic() + 300
        while len([s for s in step_rows(rd) if s.stepped]) < 3:
            assert time.monotonic() < deadline, "fewer than 3 steps in 300 s"
            time.sleep(2)
        metrics = scrape(rd)
        follow = subprocess.Popen(
            [sys.executable, "-m", "jetctl.cli.main", "logs", str(rd), "-f", "--server",
             "policy", "--grep", "draining"],
            cwd=ROOT, stdout=subprocess.PIPE, text=True,
            env={**os.environ, "PYTHONUNBUFFERED": "1"},
        )
        time.sleep(3)  # it has read what is there: no drain line yet
        assert "draining" not in (rd / "logs" / "server-policy.jsonl").read_text()
        jetctl("down", "--run-dir", str(rd))  # the server closes its trackers as it drains
        assert follow.stdout is not None
        followed = [follow.stdout.readline()]  # blocks until -f prints the new line
        follow.terminate()
        follow.wait(timeout=10)
        yield Run(rd, followed, metrics)


def test_logs_follow_prints_a_line_written_after_it_started(run: Run) -> None:
    (line,) = run.followed
    assert " server-policy " in line and "draining" in line


def test_logs_merges_every_process_in_time_order(run: Run) -> None:
    out = [x for x in jetctl("logs", str(run.dir)).stdout.splitlines() if x[:2].isdigit()]
    assert {"controller", "server-policy", "digits-0"} <= {x.split()[1] for x in out}, out
    # one day's lines (the run is minutes long): HH:MM:SS.mmm sorts as time does
    assert [x.split()[0] for x in out] == sorted(x.split()[0] for x in out)
    only = [x for x in jetctl("logs", str(run.dir), "--task", "digits").stdout.splitlines()
            if x[:2].isdigit()]
    assert only and {x.split()[1] for x in only} == {"digits-0"}, only


def test_tensorboard_holds_the_runs_reward_series(run: Run) -> None:
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    steps = step_rows(run.dir)
    acc = EventAccumulator(str(run.dir / "trackers" / "tensorboard" / "obs-policy"))
    acc.Reload()
    series = [(e.step, e.value) for e in acc.Scalars("policy/reward/mean")]
    # every row of the step log, at its step (float32 in the event file)
    assert series == [(s.step, pytest.approx(s.reward_mean, abs=1e-6)) for s in steps]
    assert len([s for s in steps if s.stepped]) >= 3
    assert [s["trackers/failures"] for s in steps] == [0.0] * len(steps)  # none failed


def test_grafana_dashboard_queries_only_metrics_a_live_run_exports(run: Run) -> None:
    missing = queried_metrics() - exported_metrics(run.metrics)
    assert not missing, sorted(missing)
    assert "jetctl_client_rollouts_total{" in run.metrics  # the node's page, with rollouts


def test_jetctl_trace_finds_a_trained_trajectorys_step_and_checkpoint(run: Run) -> None:
    from jetctl.view.stores import GroupFilter, RunView

    view = RunView(run.dir)
    (group,) = view.groups(GroupFilter(fate="trained", limit=1))
    out = jetctl("trace", group.trajectory_ids[0], str(run.dir), "--json").stdout
    lineage = json.loads(out)
    assert lineage["step"] == group.step and lineage["node"] == "digits-0"
    # the drain's checkpoint (or an earlier one) holds the step
    assert lineage["checkpoint"] and int(lineage["checkpoint"].removeprefix("step-")) >= group.step
