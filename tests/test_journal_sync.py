"""A node's ledger journal over a real Control service on loopback (jetctl.link, the
controller's hub and received copy): the journals of a client's spool and a server's store
stay bounded while the run grows, because each node prunes what the controller's Sync reply
says it holds; a controller that starts over on an empty copy gets a snapshot from each
node, and the ledger it builds is the ledger of the files themselves."""

from __future__ import annotations

import sqlite3
from contextlib import closing
from pathlib import Path

import pytest

from jetctl.client.spool import Spool
from jetctl.controller.hub import Hub
from jetctl.controller.received import Received
from jetctl.controller.service import serve_control
from jetctl.controller.state import RunState, server_node_name
from jetctl.journal import JOURNAL_TABLE, PRUNE_BATCH, SPOOL_TABLES, STORE_TABLES, Journal
from jetctl.link import ControlLink, Identity
from jetctl.proto.convert import group_to_pb
from jetctl.recipe import parse_recipe
from jetctl.run.ledger import build_ledger, ledger_from_files
from jetctl.rundir import RunPaths
from tests.factories import make_group
from tests.run.test_ledger import _store, _submit

pytestmark = pytest.mark.integration

TOKEN = "run-token"
RECIPE = (
    "models:\n  policy:\n    model: builtin:tiny\n"
    "tasks:\n  arith:\n    env: envs.digits:make_env\n    agent: agents.digits:agent\n"
    "    model: policy\n"
)


class _Controller:
    """What the Control servicer calls: the real hub, over the run's received copy."""

    def __init__(self, hub: Hub) -> None:
        self.token = TOKEN
        self.hub = hub
        self.refused_calls: dict[str, int] = {}

    def revoked(self, node: str) -> bool:
        return False


def _rows(path: Path) -> int:
    with closing(sqlite3.connect(path)) as db:
        return int(db.execute(f"SELECT COUNT(*) FROM {JOURNAL_TABLE}").fetchone()[0])


async def test_nodes_prune_what_the_controller_holds_and_rebuild_a_lost_copy(
    tmp_path: Path,
) -> None:
    paths = RunPaths(tmp_path)
    state = RunState(parse_recipe(RECIPE, env={}), tmp_path / "r.yaml", paths)
    state.phase = "running"
    ctl = _Controller(Hub(state, Received(paths.received)))
    server, port = serve_control(ctl, TOKEN)  # type: ignore[arg-type]
    store = _store(tmp_path)
    spool = Spool(paths.spool_dir / "arith-0.sqlite", keep_outcomes=20)
    spool._db.execute("PRAGMA synchronous=OFF")  # durability is not what this test reads
    nodes = [  # (link, who, journal) of the client node and of the server
        (ControlLink(f"127.0.0.1:{port}", TOKEN), Identity("arith-0", "client", task="arith"),
         Journal.install(spool.path, SPOOL_TABLES)),
        (ControlLink(f"127.0.0.1:{port}", TOKEN),
         Identity(server_node_name("policy"), "server", model="policy"),
         Journal.install(store.path, STORE_TABLES)),
    ]

    async def sync_all(final: bool = False) -> None:
        for link, who, journal in nodes:
            assert await link.sync(who, status={}, journal=journal, final=final) is not None

    def work(n: int) -> None:
        for _ in range(n):
            g = make_group()
            ids = [t.id for t in g.trajectories]
            spool.start(g.id, ids, model="policy")
            spool.put(g.id, group_to_pb(g).SerializeToString(), len(ids), trajectory_ids=ids,
                      model="policy")
            _submit(store, spool, g)

    try:
        sizes: list[int] = []
        for _ in range(6):  # ~1,800 spool records and ~600 store records
            work(40)
            await sync_all()
            sizes.append(_rows(spool.path))
        spool_journal = nodes[0][2]
        assert spool_journal.last_seq() > PRUNE_BATCH and spool_journal.pruned() > 0
        assert max(sizes) < PRUNE_BATCH, f"the journal holds less than a batch: {sizes}"
        await sync_all(final=True)
        before = build_ledger(tmp_path).summary()
        assert before["balanced"] and before["in_flight"]["server_buffer"] == 480, before

        # the controller starts over on an empty copy (its received.sqlite was deleted)
        ctl.hub.received.close()
        for suffix in ("", "-wal", "-shm"):
            Path(f"{paths.received}{suffix}").unlink(missing_ok=True)
        ctl.hub = Hub(state, Received(paths.received))
        work(5)
        await sync_all(final=True)
        after = build_ledger(tmp_path).summary()
        assert after == ledger_from_files(tmp_path).summary()
        assert after["balanced"] and after["in_flight"]["server_buffer"] == 490, after
    finally:
        for link, _, _ in nodes:
            await link.close()
        server.stop(0)
        ctl.hub.received.close()
        spool.close()
        store.close()
