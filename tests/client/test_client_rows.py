"""A client node's leased rows (jetctl.client.rows) against the controller's real lease
logic behind a fake link (no socket): acks reach the controller, a draining node stops
waiting for rows other nodes hold, and gives back what it never started."""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest

from jetctl.client.rows import LeasedRows, Picked
from jetctl.controller.rows import RowLeases, RowsCall
from jetctl.envs.dataset import DatasetEnv
from jetctl.proto._gen import control_pb2 as cpb

pytestmark = pytest.mark.unit


class LoopbackLink:
    """Control.Rows answered in process by the controller's RowLeases."""

    def __init__(self, leases: RowLeases) -> None:
        self.leases = leases

    async def rows(self, request: cpb.RowsRequest) -> cpb.RowsReply:
        lease = self.leases.lease(RowsCall(
            name=request.name, task=request.task, n_rows=request.n_rows,
            epochs=request.epochs or None, want=request.want,
            acked=tuple((p.epoch, p.index) for p in request.acked),
            released=tuple((p.epoch, p.index) for p in request.released), fresh=request.fresh,
        ), lambda _: False)
        return cpb.RowsReply(rows=[cpb.RowPosition(epoch=e, index=i) for e, i in lease.positions],
                             exhausted=lease.exhausted)


def env(tmp_path: Path) -> DatasetEnv:
    data = tmp_path / "rows.jsonl"
    data.write_text("".join(f'{{"prompt": "row {i}"}}\n' for i in range(6)))
    return DatasetEnv(path=str(data), epochs=1)


def test_two_nodes_see_every_row_once_and_a_drained_node_gives_back_the_rest(tmp_path: Path) -> None:
    async def scenario() -> tuple[list[str], list[str], RowLeases]:
        leases = RowLeases(None)
        link = LoopbackLink(leases)
        stop_a, stop_b = asyncio.Event(), asyncio.Event()
        a = LeasedRows(env(tmp_path), link, "a", "rows", 3, stop_a)  # type: ignore[arg-type]
        b = LeasedRows(env(tmp_path), link, "b", "rows", 3, stop_b)  # type: ignore[arg-type]
        first = await a.next()
        assert first is not None
        a.done(first, seen=True)
        stop_a.set()
        await a.close()  # the two rows a leased and never started go back
        seen_b: list[Picked] = []
        while (picked := await b.next()) is not None:
            b.done(picked, seen=True)
            seen_b.append(picked)
        await b.close()
        return [first.task.id], [p.task.id for p in seen_b], leases

    seen_a, seen_b, leases = asyncio.run(scenario())
    assert sorted(seen_a + seen_b) == sorted(f"train-{i}" for i in range(6))
    assert leases.progress()["rows"]["acked"] == 6


def test_a_draining_node_stops_waiting_for_rows_others_hold(tmp_path: Path) -> None:
    async def scenario() -> Picked | None:
        leases = RowLeases(None)
        leases.lease(RowsCall("other", "rows", 6, 1, want=6), lambda _: False)  # holds all
        stop = asyncio.Event()
        node = LeasedRows(env(tmp_path), LoopbackLink(leases), "a", "rows", 3, stop)  # type: ignore[arg-type]
        asyncio.get_running_loop().call_later(0.3, stop.set)
        return await asyncio.wait_for(node.next(), timeout=5)

    assert asyncio.run(scenario()) is None
