"""The controller's row leases (jetctl.controller.rows), without a socket: nodes lease, ack,
restart, leave; every position of every epoch is acked exactly once, and the state read
back from rows.json goes on where it stopped."""

from __future__ import annotations

import json
import random
from pathlib import Path

import pytest

from jetctl.controller.rows import Position, RowLeases, RowsCall, RowsRefused

pytestmark = pytest.mark.unit


def call(name: str, want: int = 0, *, acked: list[Position] | None = None,
         released: list[Position] | None = None, fresh: bool = False,
         n_rows: int = 10, epochs: int | None = 2) -> RowsCall:
    return RowsCall(name=name, task="rows", n_rows=n_rows, epochs=epochs, want=want,
                    acked=tuple(acked or ()), released=tuple(released or ()), fresh=fresh)


def test_two_nodes_with_restarts_and_a_node_leaving_ack_every_position_once(tmp_path: Path) -> None:
    path = tmp_path / "rows.json"
    leases = RowLeases(path)
    gone: set[str] = set()
    held: dict[str, list[Position]] = {"a": [], "b": []}
    acked: list[Position] = []
    rng = random.Random(0)
    fresh = {"a": True, "b": True}
    exhausted = False
    for step in range(200):
        if step == 10:
            held["a"].clear()  # a restarts: what it held is lost with the process
            fresh["a"] = True
        if step == 20:
            gone.add("b")  # b is swapped out without a word; c takes over
            del held["b"]
            held["c"], fresh["c"] = [], True
        if step == 25:
            leases = RowLeases(path)  # the controller restarts (up --resume)
        name = rng.choice(sorted(held))
        done = held[name][:rng.randint(0, len(held[name]))]
        del held[name][:len(done)]
        lease = leases.lease(call(name, want=3, acked=done, fresh=fresh[name]), gone.__contains__)
        fresh[name] = False
        acked += done
        held[name] += lease.positions
        if lease.exhausted:
            exhausted = True
            break
    assert exhausted
    assert sorted(acked) == [(e, i) for e in range(2) for i in range(10)]
    assert leases.progress()["rows"] == {"epoch": 2, "position": 0, "rows": 10, "epochs": 2,
                                         "leased": 0, "returned": 0, "acked": 20}


def test_released_rows_are_leased_again_first() -> None:
    leases = RowLeases(None)
    first = leases.lease(call("a", want=4), lambda _: False).positions
    assert first == [(0, 0), (0, 1), (0, 2), (0, 3)]
    leases.lease(call("a", released=first[2:], acked=first[:2]), lambda _: False)
    assert leases.lease(call("b", want=3), lambda _: False).positions == [(0, 2), (0, 3), (0, 4)]


def test_an_ack_after_the_rows_were_reclaimed_keeps_them_from_being_leased_again() -> None:
    leases = RowLeases(None)
    held = leases.lease(call("a", want=2), lambda _: False).positions
    leases.lease(call("b"), lambda n: n == "a")  # a looked gone: its rows went to the pool
    leases.lease(call("a", acked=held), lambda _: False)  # ... but it finished them
    assert leases.lease(call("b", want=1), lambda _: False).positions == [(0, 2)]


def test_a_node_reading_another_dataset_is_refused() -> None:
    leases = RowLeases(None)
    leases.lease(call("a", want=1), lambda _: False)
    with pytest.raises(RowsRefused, match="reads 11 rows, the run's other nodes 10"):
        leases.lease(call("b", want=1, n_rows=11), lambda _: False)


def test_status_shows_a_dataset_tasks_epoch_and_position() -> None:
    from rich.console import Console

    from jetctl.proto._gen import control_pb2 as cpb
    from jetctl.run.status import document, tasks_table

    leases = RowLeases(None)
    leases.lease(call("a", want=13), lambda _: False)
    reply = cpb.RunStatusReply(run="r", state="running")
    for task, progress in leases.progress().items():
        reply.rows_json[task] = json.dumps(progress)
    doc = document(reply)
    assert doc["tasks"]["rows"]["rows"]["leased"] == 13
    console = Console(width=200, record=True)
    console.print(tasks_table(doc))
    assert "epoch 1: 3/10" in console.export_text()
