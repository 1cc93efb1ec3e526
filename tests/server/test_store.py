"""The server's trajectory store: durable acks, dedup across restarts, buffer order."""

from __future__ import annotations

import multiprocessing
import os
import signal
import sqlite3
from pathlib import Path

import pytest

from jetctl.proto.convert import group_to_pb
from jetctl.run.ledger import Ledger, LedgerError, ledger_from_files
from jetctl.server.store import GroupFacts, Put, PutResult, TrajectoryStore
from tests.factories import make_group

pytestmark = pytest.mark.unit


def _open(path: Path, trained_through: int = 0) -> TrajectoryStore:
    store = TrajectoryStore(path)
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
    assert store.counts().groups == {"trained": 1, "buffered": 2}
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


def test_a_submits_groups_share_one_future_with_each_result_in_order(tmp_path: Path) -> None:
    """put_many (one Submit's groups) resolves once, to one result per group in order: a
    group repeated within the call hears DUPLICATE, a refusal is recorded as such, and a
    cancelled call's groups are committed all the same."""
    store = _open(tmp_path / "s.sqlite")
    a, b, stale = make_group(), make_group(), make_group()
    puts = [Put(GroupFacts.of(g), group_to_pb(g).SerializeToString()) for g in (a, b, a)]
    puts.append(Put(GroupFacts.of(stale), b"", "stale", "stale: lag 9"))
    assert [r.outcome for r in store.put_many(puts).result(5)] == [
        "accepted", "accepted", "duplicate", "stale"]
    store._db_lock.acquire()  # hold the writer so the future is still pending
    c = make_group()
    cancelled = store.put_many([Put(GroupFacts.of(c), group_to_pb(c).SerializeToString())])
    cancelled.cancel()  # True unless the writer took it already: committed either way
    store._db_lock.release()
    assert store.put(c, group_to_pb(c).SerializeToString()).result(5).outcome == "duplicate"
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


def test_a_full_buffer_refuses_new_groups_as_busy_and_stores_nothing(tmp_path: Path) -> None:
    """The buffer is bounded: past max_buffer_groups a new group is not stored (busy), a
    resend of a stored one is still a duplicate, and room made by training is used again."""
    store = TrajectoryStore(tmp_path / "s.sqlite", max_buffer_groups=2)
    store.open(trained_through_step=0)
    groups = [make_group() for _ in range(3)]
    payloads = [group_to_pb(g).SerializeToString() for g in groups]
    outcomes = [store.put(g, p).result(5).outcome for g, p in zip(groups, payloads)]
    assert outcomes == ["accepted", "accepted", "busy"]
    assert store.buffer_depth == 2 and store.recorded(groups[2].id) is None
    assert store.counts().groups == {"buffered": 2}
    assert store.put(groups[0], payloads[0]).result(5).outcome == "duplicate"
    assert store.put(groups[2], payloads[2]).result(5).outcome == "busy"
    taken = store.take(1, timeout_s=0.1)
    store.mark_trained([s.id for s in taken], step=1)
    assert store.put(groups[2], payloads[2]).result(5).outcome == "accepted"
    assert store.buffer_depth == 2
    store.close()


def test_a_refusal_has_its_own_column_and_no_reason_is_parsed(tmp_path: Path) -> None:
    """The refusal is stored as data: a reason that does not start with the code (the old
    store read the code back from the reason's prefix) keeps its refusal."""
    store = _open(tmp_path / "s.sqlite")
    stale, revision = make_group(), make_group()
    store.put(stale, b"", "stale", "lag 9 > max_staleness 2").result(5)
    store.put(revision, b"", "revision", "client revision r0 is refused").result(5)
    assert store.recorded(stale.id) == PutResult("stale", "lag 9 > max_staleness 2")
    assert store.recorded(revision.id) == PutResult("revision", "client revision r0 is refused")
    assert store.counts().rejected_groups == {"stale": 1, "revision": 1}
    accepted = make_group()
    store.put(accepted, group_to_pb(accepted).SerializeToString()).result(5)
    store.take(1, timeout_s=0.1)
    store.mark_rejected([accepted.id], "too old at batch time")
    assert store.recorded(accepted.id) == PutResult("stale", "too old at batch time")
    store.close()


OLD_SCHEMA = """
CREATE TABLE groups (id TEXT PRIMARY KEY, task TEXT NOT NULL, n_traj INTEGER NOT NULL,
    min_version INTEGER NOT NULL, state TEXT NOT NULL, reason TEXT NOT NULL DEFAULT '',
    step INTEGER, received_at REAL NOT NULL, payload BLOB,
    trajectory_ids TEXT NOT NULL DEFAULT '', revisions TEXT NOT NULL DEFAULT '',
    reward_sum REAL NOT NULL DEFAULT 0);
INSERT INTO groups (id, task, n_traj, min_version, state, reason, received_at, trajectory_ids)
VALUES ('g-stale', 'digits', 1, 0, 'rejected', 'stale: lag 3 > max_staleness 2', 1.0, 'a'),
       ('g-rev', 'digits', 1, 0, 'rejected', 'revision: client revision r0 is refused', 1.0, 'b'),
       ('g-bad', 'digits', 1, 0, 'rejected', 'invalid: token id outside the vocabulary', 1.0, 'c');
"""


def test_a_store_written_before_the_refusal_column_is_migrated_on_open(tmp_path: Path) -> None:
    path = tmp_path / "s.sqlite"
    with sqlite3.connect(path) as db:
        db.executescript(OLD_SCHEMA)
    with pytest.raises(LedgerError, match="older jetctl"):  # read-only readers refuse it
        build_ledger_of_store(path)
    store = _open(path)
    assert store.counts().rejected_groups == {"stale": 1, "revision": 1, "invalid": 1}
    assert store.recorded("g-rev") == PutResult(
        "revision", "revision: client revision r0 is refused"
    )
    store.close()
    assert build_ledger_of_store(path).rejected == {"stale": 1, "revision": 1, "invalid": 1}


def build_ledger_of_store(path: Path) -> Ledger:
    run_dir = path.parent / "run"
    (run_dir / "server-policy").mkdir(parents=True, exist_ok=True)
    target = run_dir / "server-policy" / "store.sqlite"
    target.unlink(missing_ok=True)
    target.symlink_to(path)
    return ledger_from_files(run_dir)


def test_the_buffer_keeps_the_bytes_as_received_and_decodes_on_first_use(
    tmp_path: Path,
) -> None:
    g = make_group(rewards=(0.25, 0.75))
    payload = group_to_pb(g).SerializeToString()
    store = _open(tmp_path / "s.sqlite")
    facts = GroupFacts.of(group_to_pb(g))
    assert facts == GroupFacts.of(g)
    assert store.put(facts, payload).result(5).outcome == "accepted"
    (held,) = store.take(1, timeout_s=0.1)
    assert held.payload is payload and "group" not in held.__dict__  # not decoded yet
    assert held.id == g.id and held.facts.lag(3) == 3 and held.group == g
    store.close()
    store = _open(tmp_path / "s.sqlite")  # reloaded after a restart: the same bytes, facts
    (again,) = store.take(1, timeout_s=0.1)
    assert again.payload == payload and again.facts == facts and again.group == g
    store.close()


def test_newest_first_takes_the_highest_version_and_the_oldest_wait(tmp_path: Path) -> None:
    """train.order: newest takes groups made at the highest model version first (the latest
    arrival among equals), with or without a task filter; the oldest stay buffered, and
    take_older_than hands over exactly those made before a version."""
    store = _open(tmp_path / "s.sqlite")
    made = [(0, "a"), (2, "a"), (1, "b"), (2, "b"), (0, "b")]  # (version, task), in arrival order
    groups = [make_group(version=v, task=t) for v, t in made]
    for g in groups:
        assert store.put(g, group_to_pb(g).SerializeToString()).result(5).outcome == "accepted"
    ids = {g.id: i for i, g in enumerate(groups)}
    taken = store.take(2, timeout_s=0.0, newest_first=True)
    assert [ids[s.group.id] for s in taken] == [3, 1], "version 2 first, the later arrival first"
    assert [ids[s.group.id] for s in store.take(1, 0.0, tasks={"b"}, newest_first=True)] == [2]
    old = store.take_older_than(1)
    assert [ids[s.group.id] for s in old] == [0, 4]
    assert store.buffer_depth == 0
    store.close()
