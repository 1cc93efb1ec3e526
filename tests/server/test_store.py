"""The server's trajectory store: durable acks, dedup across restarts, buffer order."""

from __future__ import annotations

import multiprocessing
import os
import signal
from pathlib import Path

import pytest

from jetctl.proto.convert import group_to_pb
from jetctl.server.store import GroupCodec, TrajectoryStore
from tests.factories import make_group

pytestmark = pytest.mark.unit


def _open(path: Path, trained_through: int = 0) -> TrajectoryStore:
    store = TrajectoryStore(path, decode=GroupCodec())
    store.open(trained_through_step=trained_through)
    return store


def test_accept_then_duplicate_across_restart(tmp_path: Path) -> None:
    g = make_group()
    payload = group_to_pb(g).SerializeToString()
    store = _open(tmp_path / "s.sqlite")
    assert store.put(g, payload).result(5).outcome == "accepted"
    assert store.put(g, payload).result(5).outcome == "duplicate"
    store.close()
    store = _open(tmp_path / "s.sqlite")
    assert store.buffer_depth == 1, "an acked, untrained group is reloaded after restart"
    assert store.put(g, payload).result(5).outcome == "duplicate"
    taken = store.take(1, timeout_s=0.1)
    assert [s.group.id for s in taken] == [g.id]
    assert taken[0].group.trajectories[1].reward == 1.0
    store.close()


def test_rejected_group_keeps_its_reason(tmp_path: Path) -> None:
    g = make_group()
    store = _open(tmp_path / "s.sqlite")
    assert store.put(g, b"", "stale", "stale: lag 9").result(5).outcome == "stale"
    again = store.put(g, group_to_pb(g).SerializeToString()).result(5)
    assert (again.outcome, again.reason) == ("stale", "stale: lag 9")
    assert store.buffer_depth == 0
    store.close()


def test_trained_after_checkpoint_goes_back_to_buffer(tmp_path: Path) -> None:
    """Steps after the restored checkpoint were lost with the weights: retrain their groups."""
    store = _open(tmp_path / "s.sqlite")
    groups = [make_group() for _ in range(3)]
    for g in groups:
        store.put(g, group_to_pb(g).SerializeToString()).result(5)
    store.take(3, timeout_s=0.1)
    store.mark_trained([groups[0].id], step=5)
    store.mark_trained([groups[1].id, groups[2].id], step=7)
    store.close()
    store = _open(tmp_path / "s.sqlite", trained_through=5)
    assert {s.group.id for s in store.take(5, timeout_s=0.1)} == {groups[1].id, groups[2].id}
    counts = store.counts()["groups"]
    assert counts == {"trained": 1, "buffered": 2}
    store.close()


def _put_and_die(path: str, conn: multiprocessing.connection.Connection) -> None:
    g = make_group()
    store = _open(Path(path))
    store.put(g, group_to_pb(g).SerializeToString()).result(5)
    conn.send(g.id)  # the ack is out: the group must survive what follows
    os.kill(os.getpid(), signal.SIGKILL)


def test_ack_survives_kill_9(tmp_path: Path) -> None:
    ctx = multiprocessing.get_context("spawn")
    parent, child = ctx.Pipe()
    p = ctx.Process(target=_put_and_die, args=(str(tmp_path / "s.sqlite"), child))
    p.start()
    acked = parent.recv()
    p.join(30)
    assert p.exitcode == -signal.SIGKILL
    store = _open(tmp_path / "s.sqlite")
    assert [s.group.id for s in store.take(1, timeout_s=0.1)] == [acked]
    store.close()


def test_a_cancelled_put_does_not_stop_the_writer(tmp_path: Path) -> None:
    """A Submit cancelled at its deadline cancels its future; the group is still committed
    and the writer keeps serving later puts (it used to die on set_result)."""
    store = _open(tmp_path / "s.sqlite")
    store._db_lock.acquire()  # hold the writer so the future is still pending
    g1, g2 = make_group(), make_group()
    fut = store.put(g1, group_to_pb(g1).SerializeToString())
    assert fut.cancel()
    store._db_lock.release()
    assert store.put(g2, group_to_pb(g2).SerializeToString()).result(5).outcome == "accepted"
    assert store.put(g1, group_to_pb(g1).SerializeToString()).result(5).outcome == "duplicate"
    store.close()


def test_reward_by_task_is_the_mean_of_each_tasks_recent_accepted_groups(tmp_path: Path) -> None:
    store = _open(tmp_path / "s.sqlite")
    groups = [
        make_group(task="web", rewards=(0.0, 0.0)),  # older than the last two web groups
        make_group(task="web", rewards=(0.0, 1.0)),
        make_group(task="web", rewards=(1.0, 1.0)),
        make_group(task="code", rewards=(0.25, 0.75, 0.5)),
    ]
    for g in groups:
        assert store.put(g, group_to_pb(g).SerializeToString()).result(5).outcome == "accepted"
    stale = make_group(task="code", rewards=(1.0, 1.0))
    store.put(stale, b"", "stale", "stale: lag 9").result(5)  # refused groups do not count
    assert store.reward_by_task(last_groups=2) == {"web": 0.75, "code": 0.5}
    assert store.reward_by_task() == {"web": 0.5, "code": 0.5}
    assert store.received_by_task() == {"web": 6, "code": 5}
    store.close()
