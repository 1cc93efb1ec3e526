"""The reward curve from a synthetic steps.jsonl."""

from __future__ import annotations

import csv
import itertools
import json
from pathlib import Path

import pytest

from jetctl.controller.plot import (
    minutes,
    moving_average,
    read_reward_points,
    step_ticks,
    write_reward_curve,
)

pytestmark = pytest.mark.unit


def test_moving_average_is_a_trailing_mean() -> None:
    assert moving_average([1.0, 2.0, 3.0, 4.0], window=2) == [1.0, 1.5, 2.5, 3.5]


def test_reward_curve_csv_and_png(tmp_path: Path) -> None:
    metrics = tmp_path / "metrics"
    metrics.mkdir()
    with open(metrics / "policy.steps.jsonl", "w") as f:
        f.writelines(json.dumps({"step": step, "time": 100.0 + step, "reward/mean": step / 12,
                                "loss": 0.1}) + "\n" for step in range(1, 13))
        f.write('{"step": 13, "reward/me')  # a line still being written
    with open(metrics / "planner.steps.jsonl", "w") as f:
        f.write(json.dumps({"step": 1, "time": 1.0, "reward/mean": -1.0}) + "\n")
        f.write(json.dumps({"step": 2, "time": 2.0, "loss": 0.3}) + "\n")  # no reward: skipped

    out = write_reward_curve(tmp_path, window=4)
    assert out is not None
    with open(tmp_path / "reward_curve.csv") as f:
        rows = list(csv.DictReader(f))
    policy = [r for r in rows if r["model"] == "policy"]
    assert [int(r["step"]) for r in policy] == list(range(1, 13))
    # step 12: mean of steps 9..12 = (9+10+11+12)/4/12
    assert float(policy[-1]["reward_mean_ma4"]) == pytest.approx(10.5 / 12, abs=1e-5)
    assert [r["reward_mean"] for r in rows if r["model"] == "planner"] == ["-1"]
    png = (tmp_path / "reward_curve.png").read_bytes()
    assert png[:8] == b"\x89PNG\r\n\x1a\n" and len(png) > 5000


def test_batches_without_a_step_keep_their_place_in_time(tmp_path: Path) -> None:
    """A batch whose groups all had zero reward variance takes no step and repeats the step
    number before it: plotted against step it would stack on it as a vertical spike; against
    time every batch has its own x, and the step axis marks only batches that stepped."""
    metrics = tmp_path / "metrics"
    metrics.mkdir()
    lines = [  # (step after the batch, stepped, seconds, reward)
        (1, 1, 10.0, 0.1), (1, 0, 20.0, 1.0), (1, 0, 30.0, 0.0), (2, 1, 40.0, 0.2),
        (3, 1, 50.0, 0.3), (3, 0, 60.0, 1.0),
    ]
    with open(metrics / "policy.steps.jsonl", "w") as f:
        f.writelines(json.dumps({"step": step, "stepped": stepped, "time": 1000.0 + t,
                                "reward/mean": r}) + "\n" for step, stepped, t, r in lines)
    points = read_reward_points(metrics / "policy.steps.jsonl")
    assert [p.batch for p in points] == [0, 1, 2, 3, 4, 5]
    x = minutes(points, start=points[0].time)
    assert all(a < b for a, b in itertools.pairwise(x)), "every batch has its own x"
    assert step_ticks(points, start=points[0].time) == [(0.0, 1), (0.5, 2), (40 / 60, 3)]
    write_reward_curve(tmp_path, window=2)
    with open(tmp_path / "reward_curve.csv") as f:
        rows = list(csv.DictReader(f))
    assert [(r["batch"], r["step"], r["stepped"], r["elapsed_s"]) for r in rows] == [
        (str(i), str(s), str(st), f"{t - 10.0:.3f}") for i, (s, st, t, _) in enumerate(lines)
    ]


def test_no_steps_writes_nothing(tmp_path: Path) -> None:
    assert write_reward_curve(tmp_path) is None
    assert not (tmp_path / "reward_curve.csv").exists()


def test_reward_by_task_is_each_tasks_groups_from_the_store(tmp_path: Path) -> None:
    """Per task: every accepted group's mean reward in the order received, and the trailing
    mean of the last 32 (what `jetctl status` shows); refused groups are left out."""
    from jetctl.proto.convert import group_to_pb
    from jetctl.server.store import TrajectoryStore
    from tests.factories import make_group

    store = TrajectoryStore(tmp_path / "server-policy" / "store.sqlite")
    store.open(trained_through_step=0)
    try:
        for i in range(40):  # web rises from 0 to 1 over 40 groups; api stays at 0.5
            web = make_group(task="web", rewards=(0.0, i / 39))
            store.put(web, group_to_pb(web).SerializeToString()).result(5)
            api = make_group(task="api", rewards=(0.5, 0.5))
            store.put(api, group_to_pb(api).SerializeToString()).result(5)
        refused = make_group(task="web", rewards=(9.0, 9.0))
        store.put(refused, b"", "stale", "stale: lag 9").result(5)
        expected_last32 = store.reward_by_task()
    finally:
        store.close()

    assert write_reward_curve(tmp_path) is None  # no steps yet, but the task curve is written
    with open(tmp_path / "reward_by_task.csv") as f:
        rows = list(csv.DictReader(f))
    web_rows = [r for r in rows if r["task"] == "web"]
    assert [int(r["group"]) for r in web_rows] == list(range(1, 41))
    assert float(web_rows[0]["reward"]) == 0.0 and float(web_rows[-1]["reward"]) == 0.5
    for task in ("web", "api"):
        last = [r for r in rows if r["task"] == task][-1]
        assert float(last["reward_last32"]) == pytest.approx(expected_last32[task], abs=1e-6)
    png = (tmp_path / "reward_by_task.png").read_bytes()
    assert png[:8] == b"\x89PNG\r\n\x1a\n"


def test_a_group_stored_after_the_last_step_redraws_the_task_curve(tmp_path: Path) -> None:
    """The controller redraws the curves when what they are made from changes: the step log,
    and also the servers' stores, so groups that arrive after the last optimizer step (a
    run's last minutes) reach reward_by_task (before, only a new step did)."""
    from jetctl.controller.controller import _curve_signature
    from jetctl.proto.convert import group_to_pb
    from jetctl.rundir import RunPaths
    from jetctl.server.store import TrajectoryStore
    from tests.factories import make_group

    paths = RunPaths(tmp_path)
    paths.metrics.mkdir(parents=True)
    (paths.metrics / "policy.steps.jsonl").write_text('{"step": 1}\n')
    store = TrajectoryStore(tmp_path / "server-policy" / "store.sqlite")
    store.open(trained_through_step=0)
    try:
        first = make_group(task="web", rewards=(0.0, 1.0))
        store.put(first, group_to_pb(first).SerializeToString()).result(5)
        before = _curve_signature(paths)
        assert before == _curve_signature(paths)  # nothing changed, nothing to redraw
        later = make_group(task="web", rewards=(1.0, 1.0))
        store.put(later, group_to_pb(later).SerializeToString()).result(5)
        assert _curve_signature(paths) != before  # no new step, but a new group
    finally:
        store.close()
