"""The ledger joins trajectory ids across the servers' stores and the clients' spools.

Real stores and spools in a temp run dir, no processes: each test makes one history (an
ack lost, a crash that loses steps, a node killed mid-rollout) and checks the ledger's
classification and whether it balances, twice: read from the files themselves, and from
what a controller received of their journals (the way a run across hosts builds it).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from jetctl.client.spool import Spool, SpooledGroup
from jetctl.controller.received import Received
from jetctl.journal import SPOOL_TABLES, STORE_TABLES, Journal
from jetctl.proto.convert import group_to_pb
from jetctl.run.ledger import Ledger, ledger_from_files
from jetctl.run.ledger import build_ledger as ledger_from_received
from jetctl.rundir import RunPaths
from jetctl.server.store import TrajectoryStore
from jetctl.types import TrajectoryGroup
from tests.factories import make_group

pytestmark = pytest.mark.unit


def _store(run_dir: Path, resumed_from: int = 0, model: str = "policy") -> TrajectoryStore:
    store = TrajectoryStore(run_dir / f"server-{model}" / "store.sqlite")
    Journal.install(store.path, STORE_TABLES)  # as the server does, before it writes
    store.open(trained_through_step=resumed_from)
    return store


def _spool(run_dir: Path, node: str = "digits-0") -> Spool:
    spool = Spool(run_dir / "spool" / f"{node}.sqlite")
    Journal.install(spool.path, SPOOL_TABLES)
    return spool


def _received(run_dir: Path) -> Ledger:
    """Every journal sent to a controller's copy in small batches, as the nodes' syncs do."""
    paths = RunPaths(run_dir)
    received = Received(paths.received)
    sources = [("server", m, p) for m, p in paths.stores().items()]
    sources += [("client", n, p) for n, p in paths.spools().items()]
    for kind, name, path in sources:
        journal = Journal.install(path, STORE_TABLES if kind == "server" else SPOOL_TABLES)
        held = received.held(journal.id)
        while batch := journal.since(held, limit=3):
            held = received.apply(name=name, kind=kind, journal=journal.id, records=batch)
        received.apply(name=name, kind=kind, journal=journal.id, records=[], final=True)
    received.close()
    return ledger_from_received(run_dir)


@pytest.fixture(params=["files", "received"])
def build_ledger(request: pytest.FixtureRequest) -> object:
    return ledger_from_files if request.param == "files" else _received


def _produce(spool: Spool, g: TrajectoryGroup) -> None:
    ids = [t.id for t in g.trajectories]
    spool.start(g.id, ids)
    spool.put(g.id, group_to_pb(g).SerializeToString(), len(ids), trajectory_ids=ids)


def _submit(store: TrajectoryStore, spool: Spool | None, g: TrajectoryGroup,
            outcome: str = "accepted") -> None:
    res = store.put(g, group_to_pb(g).SerializeToString(), outcome).result(5)  # type: ignore[arg-type]
    if spool is not None:
        spool.ack(g.id, res.outcome, res.reason)  # type: ignore[arg-type]


def test_every_outcome_is_counted_once_and_the_books_balance(tmp_path: Path, build_ledger: Any) -> None:
    store, spool = _store(tmp_path), _spool(tmp_path)
    trained, buffered, stale, pending, lost_ack = (make_group() for _ in range(5))
    for g in (trained, buffered, stale, pending, lost_ack):
        _produce(spool, g)
    _submit(store, spool, trained)
    store.take(1, 1.0)
    store.mark_trained([trained.id], step=1)
    _submit(store, spool, buffered)
    _submit(store, spool, stale, outcome="stale")
    _submit(store, None, lost_ack)  # committed, the reply never arrived: still pending
    spool.start("g-running", ["r1", "r2"])  # a rollout in progress
    spool.start("g-timeout", ["x1"])
    spool.drop("x1", "timeout", "killed at rollout_timeout_s")

    s = build_ledger(tmp_path).summary()
    assert s["trained"] == 2 and s["rejected"] == {"stale": 2}
    assert s["dropped"] == {"timeout": 1}
    assert s["in_flight"] == {"rollout": 2, "client_spool": 2, "server_buffer": 4}
    assert s["resent_after_lost_ack"] == 2, "held by the server, pending on the client: once"
    assert s["produced"] == 2 * 5 + 3 and s["balanced"], s["problems"]


def test_an_acked_group_no_server_has_is_lost(tmp_path: Path, build_ledger: Any) -> None:
    _store(tmp_path)
    spool = _spool(tmp_path)
    g = make_group()
    _produce(spool, g)
    spool.ack(g.id, "accepted")  # an ack without the durable write behind it
    ledger = build_ledger(tmp_path)
    assert not ledger.balanced and ledger.count("lost") == 2


def test_steps_lost_in_a_crash_are_trained_again_once(tmp_path: Path, build_ledger: Any) -> None:
    store, spool = _store(tmp_path), _spool(tmp_path)
    early, late = make_group(), make_group()
    for g in (early, late):
        _produce(spool, g)
        _submit(store, spool, g)
    store.take(2, 1.0)
    store.mark_trained([early.id], step=5)  # in the checkpoint at 5
    store.mark_trained([late.id], step=7)  # after it: lost with the crash
    store.close()
    store = _store(tmp_path, resumed_from=5)  # restart from the checkpoint at 5
    assert [s.group.id for s in store.take(1, 1.0)] == [late.id], "step 7 goes back to the buffer"
    store.mark_trained([late.id], step=6)
    assert build_ledger(tmp_path).balanced

    # a store that trained a surviving group again would be caught
    store.mark_trained([early.id], step=7)
    ledger = build_ledger(tmp_path)
    assert ledger.count("trained_twice") == 2 and not ledger.balanced


def test_a_killed_node_loses_its_rollouts_never_half_a_group(tmp_path: Path, build_ledger: Any) -> None:
    spool = _spool(tmp_path)
    spool.start("g1", ["a", "b", "c"])
    spool.drop("c", "failed", "agent raised")
    spool.close()  # kill -9 here: a and b were running
    spool = _spool(tmp_path)
    assert spool.recover_lost("node died") == 2
    assert spool.recover_lost("node died") == 0
    s = build_ledger(tmp_path).summary()
    assert s["dropped"] == {"failed": 1, "lost": 2} and s["balanced"]


def test_one_trajectory_in_two_places_is_a_conflict(tmp_path: Path, build_ledger: Any) -> None:
    store, spool = _store(tmp_path), _spool(tmp_path)
    g = make_group()
    _produce(spool, g)
    _submit(store, spool, g)
    spool.drop(g.trajectories[0].id, "timeout", "and also dropped?")
    ledger = build_ledger(tmp_path)
    assert ledger.count("conflict") == 1 and not ledger.balanced


def test_a_teams_books_balance_per_model_when_one_part_is_stale(
    tmp_path: Path, build_ledger: Any
) -> None:
    """A team's rollouts make one group per model; the planner's part is trained, the coder's
    is refused as stale: each is accounted for on the client and on its own server."""
    planner, coder = _store(tmp_path, model="planner"), _store(tmp_path, model="coder")
    spool = _spool(tmp_path, "team-0")
    parts = {"planner": make_group(model="planner"), "coder": make_group(model="coder")}
    for model, g in parts.items():
        spool.start(g.id, [t.id for t in g.trajectories], model=model)
    spool.put_all([
        SpooledGroup(g.id, group_to_pb(g).SerializeToString(), [t.id for t in g.trajectories],
                     model)
        for model, g in parts.items()
    ])
    _submit(planner, spool, parts["planner"])
    planner.take(1, 1.0)
    planner.mark_trained([parts["planner"].id], step=1)
    _submit(coder, spool, parts["coder"], outcome="stale")
    spool.start("g-next", ["n1", "n2"], model="coder")  # the coder's next part, running

    ledger = build_ledger(tmp_path)
    s = ledger.summary()
    assert s["balanced"] and s["trained"] == 2 and s["rejected"] == {"stale": 2}
    assert s["by_model"]["planner"] == {
        "produced": 2, "trained": 2, "rejected": {}, "dropped": {}, "in_flight": {},
        "awaiting_reports": 0, "lost": 0, "problems": 0, "balanced": True}
    assert s["by_model"]["coder"] == {
        "produced": 4, "trained": 0, "rejected": {"stale": 2}, "dropped": {},
        "in_flight": {"rollout": 2}, "awaiting_reports": 0, "lost": 0, "problems": 0,
        "balanced": True}
    assert "model coder: produced 4" in ledger.render()

    # an ack for a part the coder's server never stored unbalances the coder's books only
    lost = make_group(model="coder")
    spool.start(lost.id, [t.id for t in lost.trajectories], model="coder")
    spool.put(lost.id, group_to_pb(lost).SerializeToString(), 2,
              trajectory_ids=[t.id for t in lost.trajectories], model="coder")
    spool.ack(lost.id, "accepted")
    s = build_ledger(tmp_path).summary()
    assert not s["by_model"]["coder"]["balanced"] and s["by_model"]["coder"]["lost"] == 2
    assert s["by_model"]["planner"]["balanced"]
