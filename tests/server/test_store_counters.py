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
