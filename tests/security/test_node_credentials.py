"""Per-node credentials at the controller, over a real gRPC socket on loopback.

A client node's credential (jetctl.auth) joins and syncs as its own node and does nothing
else: another node's Sync, Down, SwapClients and the run's Status are PERMISSION_DENIED; a
node a swap retired (revoked) is refused even its own Sync; a forged credential is
UNAUTHENTICATED; each refusal is counted. The run token does everything.
"""

from __future__ import annotations

from typing import Any

import grpc
import pytest

from jetctl import auth
from jetctl.controller.service import serve_control
from jetctl.link import call_control
from jetctl.proto._gen import control_pb2 as cpb

pytestmark = pytest.mark.integration

TOKEN = "run-token"


class _Hub:
    def sync(self, req: cpb.SyncRequest) -> cpb.SyncReply:
        return cpb.SyncReply(known=True)


class _Controller:
    """What the Control servicer calls, recorded."""

    def __init__(self) -> None:
        self.token = TOKEN
        self.refused_calls: dict[str, int] = {}
        self.retired = {"arith-0"}
        self.hub = _Hub()
        self.stopped: list[str] = []

    def revoked(self, node: str) -> bool:
        return node in self.retired

    def request_stop(self, reason: str, grace_s: float | None = None) -> None:
        self.stopped.append(reason)

    def status(self) -> cpb.RunStatusReply:
        return cpb.RunStatusReply(run="t")


def _code(endpoint: str, token: str, method: str, request: Any) -> str:
    try:
        call_control(endpoint, token, method, request)
    except grpc.RpcError as e:
        return str(e.code().name)
    return "OK"


def test_a_node_credential_syncs_as_itself_only_until_revoked() -> None:
    ctl = _Controller()
    server, port = serve_control(ctl, TOKEN)  # type: ignore[arg-type]
    endpoint = f"127.0.0.1:{port}"
    mine = auth.node_credential(TOKEN, "arith-1", ["policy"])
    try:
        assert _code(endpoint, mine, "Sync", cpb.SyncRequest(name="arith-1")) == "OK"
        assert _code(endpoint, mine, "Sync", cpb.SyncRequest(name="arith-2")) == "PERMISSION_DENIED"
        assert _code(endpoint, mine, "Down", cpb.DownRequest()) == "PERMISSION_DENIED"
        assert _code(endpoint, mine, "SwapClients", cpb.SwapRequest(task="arith")) == (
            "PERMISSION_DENIED")
        assert _code(endpoint, mine, "Status", cpb.RunStatusRequest()) == "PERMISSION_DENIED"
        assert ctl.stopped == [], "Down with a node's credential did nothing"

        retired = auth.node_credential(TOKEN, "arith-0", ["policy"])
        assert _code(endpoint, retired, "Sync", cpb.SyncRequest(name="arith-0")) == (
            "PERMISSION_DENIED")
        forged = auth.node_credential("guessed", "arith-1", ["policy"])
        assert _code(endpoint, forged, "Sync", cpb.SyncRequest(name="arith-1")) == (
            "UNAUTHENTICATED")

        assert ctl.refused_calls == {"permission_denied": 4, "revoked": 1, "unauthenticated": 1}
        assert _code(endpoint, TOKEN, "Down", cpb.DownRequest()) == "OK"
        assert ctl.stopped == ["down"]
    finally:
        server.stop(0)


def test_servers_learn_the_revoked_nodes_at_their_sync(tmp_path: Any) -> None:
    """The controller's Sync reply to a server lists the nodes a swap retired (the server's
    interceptor then refuses their credentials: tests/server/test_auth.py); a client's
    reply does not carry the list."""
    from jetctl.controller.hub import Hub
    from jetctl.controller.received import Received
    from jetctl.controller.state import RunState
    from jetctl.recipe import parse_recipe
    from jetctl.rundir import RunPaths

    recipe = parse_recipe(
        "models:\n  policy:\n    model: builtin:tiny\n"
        "tasks:\n  arith:\n    env: envs.digits:make_env\n    agent: agents.digits:agent\n"
        "    model: policy\n", env={},
    )
    state = RunState(recipe, tmp_path / "r.yaml", RunPaths(tmp_path))
    state.retired |= {"arith-0", "arith-1"}
    hub = Hub(state, Received(tmp_path / "received.sqlite"))
    to_server = hub.sync(cpb.SyncRequest(name="server-policy", kind="server", model="policy"))
    assert list(to_server.revoked_nodes) == ["arith-0", "arith-1"]
    to_client = hub.sync(cpb.SyncRequest(name="arith-0", kind="client", task="arith"))
    assert list(to_client.revoked_nodes) == [] and to_client.drain
