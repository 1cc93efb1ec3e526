"""Mixing ratios (`train.mix`): the batch builder holds each task's share of every batch.

The quotas alone (pure), then the trainer on builtin:tiny with a real store fed by one
thread per task: a task whose groups arrive at a third of the other's speed still gets its
share of every batch (the builder waits for it, and shows it starving), and a task that
stops is waited for `mix_wait_s`, then back-filled and counted.
"""

from __future__ import annotations

import threading
import time
from collections import Counter
from pathlib import Path

import pytest

from jetctl.proto.convert import group_to_pb
from jetctl.server.mixing import BatchMix
from jetctl.server.trainer import Trainer
from tests.factories import make_group
from tests.server.trainer_support import PROMPT, config, make_trainer, step

pytestmark = pytest.mark.unit


def put(trainer: Trainer, task: str, version: int | None = None) -> None:
    """An informative group of `task`, made at `version` (default: the trainer's), as Submit
    stores it."""
    g = make_group(task=task, rewards=(0.0, 1.0),
                   version=trainer.version if version is None else version, prompt=PROMPT,
                   completion=(21, 22, 23))
    assert trainer.store.put(g, group_to_pb(g).SerializeToString()).result(5).outcome == "accepted"


def test_quotas_hold_each_share_within_one_group_over_many_batches() -> None:
    mix = BatchMix({"web": 0.5, "code": 0.3, "api": 0.2}, groups_per_step=4, wait_s=1.0)
    total: Counter[str] = Counter()
    for n in range(1, 51):
        quotas = mix.quotas()
        assert sum(quotas.values()) == 4
        total.update(quotas)
        for task, share in mix.shares.items():
            assert abs(total[task] - share * 4 * n) < 1.0 + 1e-9, (n, dict(total))
    assert dict(total) == {"web": 100, "code": 60, "api": 40}


@pytest.mark.timeout(120)
def test_batches_hold_the_mix_while_one_task_arrives_at_a_third_of_the_speed(
    tmp_path: Path,
) -> None:
    trainer = make_trainer(tmp_path, config(
        groups_per_step=4, max_staleness=1000, mix={"fast": 0.5, "slow": 0.5}, mix_wait_s=30.0))
    stop = threading.Event()

    def feed(task: str, every_s: float) -> None:
        while not stop.wait(every_s):
            put(trainer, task)

    feeders = [threading.Thread(target=feed, args=("fast", 0.03), daemon=True),
               threading.Thread(target=feed, args=("slow", 0.09), daemon=True)]
    for f in feeders:
        f.start()
    try:
        deadline = time.monotonic() + 90
        while trainer.version < 20:
            assert time.monotonic() < deadline, trainer.version
            step(trainer)
    finally:
        stop.set()
        for f in feeders:
            f.join(5)
    assert trainer.mix is not None
    batches = list(trainer.mix.recent)
    assert len(batches) == 20
    # arrival order would have given fast about three quarters of every batch
    received = trainer.store.received_by_task()
    assert received["fast"] > 2 * received["slow"], received
    shares = trainer.mix.figures()
    for task in ("fast", "slow"):
        assert shares[task]["share"] == pytest.approx(0.5, abs=0.05), shares
    assert all(dict(b.taken) == {"fast": 2, "slow": 2} for b in batches)
    assert not any(b.backfilled for b in batches), "the wait (30 s) was never used up"
    # the builder waited for slow: shown starving; fast, always full first, is not
    assert shares["slow"]["starving"] == 1.0 and shares["fast"]["starving"] == 0.0


@pytest.mark.timeout(60)
def test_a_task_that_stops_is_back_filled_after_the_wait_and_counted(tmp_path: Path) -> None:
    wait_s = 0.3
    trainer = make_trainer(tmp_path, config(
        groups_per_step=4, max_staleness=1000, mix={"fast": 0.5, "slow": 0.5},
        mix_wait_s=wait_s))
    for _ in range(12):
        put(trainer, "fast")
    put(trainer, "slow")  # one group of slow, then nothing
    started = time.monotonic()
    while trainer.version < 3:
        assert time.monotonic() - started < 30
        step(trainer)
    took = time.monotonic() - started
    assert trainer.mix is not None
    batches = list(trainer.mix.recent)
    assert [dict(b.taken) for b in batches] == [{"fast": 3, "slow": 1}, {"fast": 4}, {"fast": 4}]
    assert [dict(b.backfilled) for b in batches] == [{"slow": 1}, {"slow": 2}, {"slow": 2}]
    assert trainer.mix.backfilled_total == Counter({"slow": 5})
    assert took >= 3 * wait_s, "each batch waited for slow before back-filling"
    figures = trainer.mix.figures()
    assert figures["slow"]["starving"] == 1.0 and figures["slow"]["backfilled"] == 5
    assert figures["fast"]["share"] == pytest.approx(11 / 12)


def test_staleness_is_each_tasks_mean_lag_at_the_step(tmp_path: Path) -> None:
    """Status.staleness_by_task: per task, how many versions behind its trained groups were
    when a step took them (mean of the last 32), so a task whose clients lag shows it."""
    trainer = make_trainer(tmp_path, config(groups_per_step=2, max_staleness=1000))
    for _ in range(3):
        put(trainer, "fresh")
        put(trainer, "fresh")
        assert step(trainer) is not None
    assert trainer.version == 3
    assert trainer.figures.staleness_by_task() == {"fresh": 0.0}
    put(trainer, "lagging", version=0)  # 3 versions behind
    put(trainer, "lagging", version=2)  # 1 behind
    assert step(trainer) is not None
    put(trainer, "fresh")
    put(trainer, "lagging", version=1)  # 3 behind at version 4
    assert step(trainer) is not None
    assert trainer.figures.staleness_by_task() == {
        "fresh": pytest.approx(0.0), "lagging": pytest.approx((3 + 1 + 3) / 3)}
