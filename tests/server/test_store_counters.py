"""Status reads running counters, not the table (issue 25): after any mix of accepts,
refusals, training, batch-time rejections and a restart, the counters equal a full scan of
the table, and reading them never waits for the store's writer."""

from __future__ import annotations

import random
import threading
import time
from pathlib import Path

import pytest

from jetctl.proto.convert import group_to_pb
from jetctl.server.figures import RecentRate
from jetctl.server.store import REWARD_WINDOW, StoreCounts, TrajectoryStore, _Tally
from tests.factories import make_group

pytestmark = pytest.mark.unit


def _scanned(store: TrajectoryStore) -> tuple[StoreCounts, dict[str, int], dict[str, float]]:
    """What the counters must say, read from the table as the old Status did."""
    fresh = _Tally()
    fresh.load(store._db)
    return fresh.counts(), fresh.received_by_task(), fresh.reward_by_task(REWARD_WINDOW)


def _figures(store: TrajectoryStore) -> tuple[StoreCounts, dict[str, int], dict[str, float]]:
    return store.counts(), store.received_by_task(), store.reward_by_task()


def test_the_counters_equal_a_scan_of_the_table_after_any_history(tmp_path: Path) -> None:
    rng = random.Random(25)
    path = tmp_path / "s.sqlite"
    store = TrajectoryStore(path, max_buffer_groups=40)
    store.open(trained_through_step=0)
    step = 0
    for _ in range(6):
        for _ in range(rng.randint(5, 15)):
            g = make_group(task=rng.choice(["web", "code", "math"]),
                           rewards=tuple(rng.choice([0.0, 0.5, 1.0]) for _ in range(rng.randint(2, 4))))
            outcome = rng.choice(["accepted"] * 4 + ["stale", "revision"])
            payload = group_to_pb(g).SerializeToString() if outcome == "accepted" else b""
            store.put(g, payload, outcome, "why").result(5)  # type: ignore[arg-type]
            if rng.random() < 0.2:
                store.put(g, payload).result(5)  # a resend: duplicate, nothing counted
        taken = store.take(rng.randint(1, 8), timeout_s=0.05)
        cut = rng.randint(0, len(taken))
        step += 1
        store.mark_trained([s.id for s in taken[:cut]], step=step)
        store.mark_rejected([s.id for s in taken[cut:]], "too old at batch time")
        assert _figures(store) == _scanned(store)
    counts = store.counts()
    assert counts.groups.get("trained") and counts.rejected_groups.get("stale")
    store.close()
    # a restart from an earlier checkpoint moves groups back to the buffer
    store = TrajectoryStore(path, max_buffer_groups=40)
    store.open(trained_through_step=step // 2)
    assert _figures(store) == _scanned(store)
    assert store.counts().groups["buffered"] > counts.groups.get("buffered", 0)
    store.close()


def test_a_task_keeps_its_last_window_of_groups_for_its_reward(tmp_path: Path) -> None:
    store = TrajectoryStore(tmp_path / "s.sqlite", max_buffer_groups=200)
    store.open(trained_through_step=0)
    for i in range(REWARD_WINDOW + 10):
        reward = 0.0 if i < 10 else 1.0  # the 10 oldest fall out of the window
        g = make_group(task="web", rewards=(reward, reward))
        store.put(g, group_to_pb(g).SerializeToString()).result(5)
    assert store.reward_by_task() == {"web": 1.0}
    assert store.received_by_task() == {"web": 2 * (REWARD_WINDOW + 10)}
    with pytest.raises(ValueError, match="last_groups"):
        store.reward_by_task(last_groups=REWARD_WINDOW + 1)
    store.close()


def test_status_figures_never_wait_for_the_writer(tmp_path: Path) -> None:
    """A transaction holding the store's lock (the writer committing a batch, a checkpoint's
    update) does not hold up the counts: Status reads them in well under a millisecond."""
    store = TrajectoryStore(tmp_path / "s.sqlite")
    store.open(trained_through_step=0)
    g = make_group()
    store.put(g, group_to_pb(g).SerializeToString()).result(5)
    held, release = threading.Event(), threading.Event()

    def hold() -> None:
        with store._db_lock:
            held.set()
            release.wait(10)

    holder = threading.Thread(target=hold)
    holder.start()
    held.wait(5)
    try:
        t0 = time.monotonic()
        figures = _figures(store)
        elapsed = time.monotonic() - t0
    finally:
        release.set()
        holder.join()
    assert figures[0].groups == {"buffered": 1} and figures[1] == {"digits": 2}
    assert elapsed < 0.5, f"the figures waited {elapsed:.2f}s for the writer's lock"
    store.close()


def test_the_accepted_rate_is_bounded_without_anyone_reading_it() -> None:
    rate = RecentRate(window_s=60)
    for second in range(10_000):
        rate.add(3, now=float(second))
    assert len(rate._buckets) <= 61
    assert rate.total(now=9_999.5) == 3 * 60
    assert rate.total(now=20_000.0) == 0


def _old_run(path: Path, forgotten: int) -> TrajectoryStore:
    """A store whose table holds `forgotten` groups trained long ago (payloads dropped at
    earlier checkpoints, as an old run's table is: written directly, the history itself is
    not what is checked), then 8 groups put, taken and trained at steps 1000 and 1001."""
    store = TrajectoryStore(path, max_buffer_groups=64)
    store.open(trained_through_step=0)
    store._db.executemany(
        "INSERT INTO groups (id, task, n_traj, min_version, state, step, received_at, payload) "
        "VALUES (?, 'digits', 2, 0, 'trained', ?, 0, NULL)",
        [(f"old-{i}", i // 32) for i in range(forgotten)])
    groups = [make_group() for _ in range(8)]
    for g in groups:
        store.put(g, group_to_pb(g).SerializeToString()).result(5)
    taken = store.take(8, timeout_s=1.0)
    store.mark_trained([s.id for s in taken[:4]], step=1000)
    store.mark_trained([s.id for s in taken[4:]], step=1001)
    return store


def _vm_steps_of_forget(store: TrajectoryStore, through_step: int) -> int:
    """sqlite VM instructions (in hundreds) forget_payloads ran: its cost, without a clock."""
    ticks = 0

    def tick() -> int:
        nonlocal ticks
        ticks += 1
        return 0

    store._db.set_progress_handler(tick, 100)
    try:
        store.forget_payloads(through_step=through_step)
    finally:
        store._db.set_progress_handler(None, 100)
    return ticks


def test_forgetting_payloads_at_a_checkpoint_costs_the_same_at_any_age(tmp_path: Path) -> None:
    """Each checkpoint drops the payloads of the groups trained up to it. It used to find
    them among every trained group of the run (0.44 s a checkpoint, under the store's lock,
    at 440k groups: `jetctl bench soak` slowed as it aged); it reads only the groups that
    still hold one, so a week-old run forgets as cheaply as a new one. And it forgets the
    right ones: those trained through the step, not the later ones."""
    young = _old_run(tmp_path / "young.sqlite", forgotten=500)
    old = _old_run(tmp_path / "old.sqlite", forgotten=20_000)
    cost_young = _vm_steps_of_forget(young, through_step=1000)
    cost_old = _vm_steps_of_forget(old, through_step=1000)
    assert cost_old <= 2 * max(cost_young, 1), (cost_young, cost_old)
    for store in (young, old):
        held = dict(store._db.execute(
            "SELECT step, COUNT(*) FROM groups WHERE payload IS NOT NULL GROUP BY step"))
        assert held == {1001: 4}, held
        store.close()
