"""Groups consumed without signal are not held until the next step (issue 25): a run whose
groups all lack signal takes no step, and holding each group (its payload and decoded
trajectories) grew the server ~18 KB a group (`jetctl bench soak`). The trainer keeps what
the next step's row needs; the groups themselves are freed."""

from __future__ import annotations

import gc
import weakref
from pathlib import Path

import pytest

from tests.server.trainer_support import config, make_trainer, step, submit

pytestmark = pytest.mark.unit


def test_groups_without_signal_are_freed_and_still_counted_in_the_next_row(
    tmp_path: Path,
) -> None:
    trainer = make_trainer(tmp_path, config(groups_per_step=1))
    for _ in range(5):
        submit(trainer, rewards=(0.5, 0.5))
    taken = []
    real_take = trainer.store.take

    def take_and_watch(*args: object, **kwargs: object) -> list:  # type: ignore[type-arg]
        found = real_take(*args, **kwargs)  # type: ignore[arg-type]
        taken.extend(weakref.ref(s) for s in found)
        return found

    trainer.store.take = take_and_watch  # type: ignore[method-assign]
    for _ in range(6):
        assert step(trainer) is None, "no signal: no step"
    gc.collect()
    assert len(taken) == 5 and all(ref() is None for ref in taken), "no skipped group is held"
    submit(trainer, rewards=(0.0, 1.0))
    row = None
    for _ in range(3):
        row = step(trainer) or row
    assert row is not None and row["groups/skipped"] == 5
    assert row["trajectories/skipped"] == 10
    assert row["reward/mean"] == pytest.approx((5 * 2 * 0.5 + 1.0) / 12)
