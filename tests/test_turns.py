"""The turn barrier (jetctl/turns.py): rollouts of different lengths, one raising, each turn
holding exactly one call of every rollout still running."""

from __future__ import annotations

import threading
from dataclasses import dataclass, field

import pytest

from jetctl.turns import TurnBarrier

pytestmark = [pytest.mark.unit, pytest.mark.timeout(30)]


@dataclass
class Call:
    rollout: int
    turn: int
    done: threading.Event = field(default_factory=threading.Event)
    reply: str = ""


def test_each_turn_holds_one_call_of_every_live_rollout_until_all_ended() -> None:
    lengths = [1, 3, 2, 0]  # model calls per rollout; rollout 3 raises before its first
    barrier: TurnBarrier[Call] = TurnBarrier(len(lengths))
    replies: dict[int, list[str]] = {i: [] for i in range(len(lengths))}

    def rollout(i: int) -> None:
        try:
            if lengths[i] == 0:
                raise RuntimeError("the agent failed")
            for turn in range(lengths[i]):
                replies[i].append(barrier.ask(Call(i, turn)).reply)
        except RuntimeError:
            pass
        finally:
            barrier.finished()

    threads = [threading.Thread(target=rollout, args=(i,), daemon=True)
               for i in range(len(lengths))]
    for t in threads:
        t.start()
    turns: list[list[tuple[int, int]]] = []
    while (calls := barrier.next_turn()) is not None:
        turns.append(sorted((c.rollout, c.turn) for c in calls))
        for c in calls:
            c.reply = f"{c.rollout}.{c.turn}"
            c.done.set()
    for t in threads:
        t.join(timeout=5)

    assert turns == [[(0, 0), (1, 0), (2, 0)], [(1, 1), (2, 1)], [(1, 2)]]
    assert replies == {0: ["0.0"], 1: ["1.0", "1.1", "1.2"], 2: ["2.0", "2.1"], 3: []}
