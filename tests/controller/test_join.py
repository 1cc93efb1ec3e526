"""Nodes joining by hand (`Control.Join` without a name), with fake nodes for the rest: the
controller names and counts them, shows them until their syncs stop, drains them on a swap
and on down, and keeps what their syncs carried. The real thing across hosts is in
tests/multihost/test_hosts.py."""

from __future__ import annotations

import json
import threading
import time
from pathlib import Path
from typing import Any

import grpc
import pytest

from jetctl.link import call_control
from jetctl.proto._gen import control_pb2 as cpb
from tests.controller.controller_fakes import node_states, read_run_json, recipe_dict, wait_for

pytestmark = [pytest.mark.integration, pytest.mark.timeout(90)]


class ByHand:
    """A node joined by hand, syncing from the test: sync() once, or keep syncing."""

    def __init__(self, ctl: Any, task: str = "arith") -> None:
        self.ctl = ctl
        self.reply = self.call("Join", cpb.JoinRequest(kind="client", task=task, index=-1,
                                                       host="elsewhere"))
        self.name = self.reply.name
        self.drained = threading.Event()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def call(self, method: str, request: Any) -> Any:
        return call_control(self.ctl.endpoint, self.ctl.token, method, request)

    def sync(self, state: str = "running", final: bool = False) -> Any:
        status = {"state": state, "spool_depth": 0, "address": "10.9.9.9"}
        return self.call("Sync", cpb.SyncRequest(
            name=self.name, kind="client", task="arith", revision=self.reply.revision,
            status_json=json.dumps(status), final=final, host="elsewhere",
        ))

    def keep_syncing(self) -> ByHand:
        def loop() -> None:
            while not self._stop.wait(0.1):
                if self.sync().drain:
                    self.sync(state="exited", final=True)  # a real node flushes, then this
                    self.drained.set()
                    return

        self._thread = threading.Thread(target=loop, daemon=True)
        self._thread.start()
        return self

    def stop(self) -> None:
        self._stop.set()


def test_a_node_joining_by_hand_is_named_counted_and_shown(make_controller, run_dir: Path,
                                                           monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr("jetctl.controller.state.UNREACHABLE_S", 1.0)
    r = make_controller(recipe_dict(clients=2)).start()
    wait_for(r.all_running, what="every node running")
    node = ByHand(r.ctl)
    assert node.name == "arith-j2" and node.reply.index == 2, "after the recipe's nodes"
    assert json.loads(node.reply.task_json)["env"] == "envs.fake:make_env"
    assert node.reply.servers["policy"], "it gets the server's endpoint"
    node.sync()
    assert node_states(r.ctl)[node.name] == "running"
    (status,) = [n for n in r.ctl.status().nodes if n.name == node.name]
    assert json.loads(status.json)["address"] == "10.9.9.9"
    entry = wait_for(lambda: read_run_json(run_dir)["clients"].get(node.name), what="run.json")
    assert entry["runtime"] == "joined" and entry["host"] == "elsewhere"
    time.sleep(1.5)  # its syncs stop
    assert node_states(r.ctl)[node.name] == "unreachable"
    node.sync()
    assert node_states(r.ctl)[node.name] == "running", "back once it syncs again"


def test_joining_an_unknown_task_is_refused_with_the_known_ones(make_controller) -> None:
    r = make_controller(recipe_dict(clients=1)).start()
    with pytest.raises(grpc.RpcError) as caught:
        call_control(r.ctl.endpoint, r.ctl.token, "Join",
                     cpb.JoinRequest(kind="client", task="nope", index=-1))
    assert caught.value.code() == grpc.StatusCode.NOT_FOUND
    assert "tasks: arith" in caught.value.details()


def test_a_swap_and_down_drain_the_nodes_that_joined_by_hand(make_controller) -> None:
    r = make_controller(recipe_dict(clients=1)).start()
    wait_for(r.all_running, what="every node running")
    first = ByHand(r.ctl).keep_syncing()
    wait_for(lambda: node_states(r.ctl).get(first.name) == "running", what="the joined node")

    result = r.ctl.swap_clients("arith", agent="agents.other:agent", grace_s=10.0)
    assert result.ok, result.message
    assert first.drained.is_set(), "told to drain at its next sync"
    assert first.name not in node_states(r.ctl), "retired with the old revision"
    assert first.sync().drain, "a late sync from a retired node is told to drain again"
    first.stop()

    second = ByHand(r.ctl).keep_syncing()
    assert second.reply.revision == "r1" and second.reply.agent == "agents.other:agent"
    wait_for(lambda: node_states(r.ctl).get(second.name) == "running", what="the joined node")
    assert r.stop(grace_s=10) == "test"
    assert second.drained.is_set(), "down drains it too"


def test_a_node_from_elsewhere_ships_its_log_lines_and_the_controller_trusts_none(
    make_controller, run_dir: Path,
) -> None:
    """A node that joined by hand keeps its log files on its own host: the Join reply asks for
    its lines, its Sync carries them (the real ControlLink with a LogShipper on a logger), and
    the controller appends them to its own logs/<node>.jsonl, where `jetctl logs` reads them.
    A line that is not a bounded JSON object is refused, one that names another process is
    written under the node's own name, and a node the controller runs here ships nothing."""
    import asyncio
    import logging

    from jetctl.link import ControlLink, Identity
    from jetctl.logs import LINE_MAX_BYTES, LogFilter, LogShipper, read_lines

    r = make_controller(recipe_dict(clients=1)).start()
    wait_for(r.all_running, what="every node running")
    here = call_control(r.ctl.endpoint, r.ctl.token, "Join", cpb.JoinRequest(
        kind="client", task="arith", name="arith-0", index=0))
    assert here.ship_logs is False  # started here: its logs are in this run dir already
    node = ByHand(r.ctl)
    assert node.reply.ship_logs is True

    shipper = LogShipper(node.name, {"task": "arith"})
    logger = logging.getLogger("test.shipped")
    logger.addHandler(shipper)
    logger.setLevel(logging.INFO)
    try:
        logger.info("rollout %d finished", 7)
        logger.warning("env slow")
        logger.debug("not shipped: below INFO")
    finally:
        logger.removeHandler(shipper)
    shipper.put_back([
        "not json", json.dumps({"time": 1.0, "message": "x" * LINE_MAX_BYTES}),
        json.dumps({"time": 2.0, "process": "server-policy", "message": "forged"}),
    ])

    async def sync_once() -> Any:
        link = ControlLink(r.ctl.endpoint, r.ctl.token)
        link.log_shipper = shipper
        try:
            return await link.sync(Identity(node.name, "client", task="arith",
                                            revision=node.reply.revision),
                                   status={"state": "running"})
        finally:
            await link.close()

    assert asyncio.run(sync_once()) is not None
    assert shipper.take() == []  # all sent
    lines = read_lines(run_dir / "logs", LogFilter(node=node.name))
    assert [ln.message for ln in lines] == ["forged", "rollout 7 finished", "env slow"]
    assert {ln.process for ln in lines} == {node.name}
    assert lines[1].fields["task"] == "arith" and lines[2].level == "WARNING"
    assert r.ctl._hub.logs.refused == 2
    assert not read_lines(run_dir / "logs", LogFilter(node="server-policy"))


def test_a_shipper_keeps_lines_until_a_sync_takes_them_and_bounds_its_backlog(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    from jetctl import logs

    monkeypatch.setattr(logs, "SHIP_BACKLOG", 3)
    shipper = logs.LogShipper("n", {})
    for i in range(5):
        shipper.emit(logging_record(f"m{i}"))
    assert shipper.dropped == 2
    first = shipper.take(max_bytes=1)  # at least one line per sync, whatever its size
    assert [json.loads(x)["message"] for x in first] == ["m2"]
    shipper.put_back(first)  # the sync failed: they go first next time
    assert [json.loads(x)["message"] for x in shipper.take()] == ["m2", "m3", "m4"]


def logging_record(message: str) -> Any:
    import logging

    return logging.LogRecord("t", logging.INFO, __file__, 1, message, None, None)
