"""`tasks.<t>.network`, wired through the recipe: isolated by default (the run's network,
only the controller's and the task's servers' ports open to it), `host` on request, and
refused on a task that does not run in docker. No engine needed: the specs are what the
reconciler hands the docker runtime (test_hostile_client.py runs them for real)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from jetctl import auth
from jetctl.controller.controller import Controller
from jetctl.controller.runtimes.docker import RunNetwork
from jetctl.recipe import RecipeError, parse_recipe
from jetctl.rundir import TOKEN_ENV

pytestmark = pytest.mark.unit

RECIPE = """\
models:
  policy:
    model: builtin:tiny
tasks:
  digits:
    env: envs.digits:make_env
    agent: agents.digits:agent
    model: policy
"""


class _Docker:
    """Stands in for DockerRuntime where only its network's gateway is asked for."""

    def network(self) -> RunNetwork:
        return RunNetwork(name="jetctl-t", gateway="172.30.0.1", bridge="br-t")


def _specs(tmp_path: Path, extra: str) -> tuple[Controller, dict[str, Any]]:
    path = tmp_path / "r.yaml"
    path.write_text(RECIPE + "    runtime: docker\n" + extra)
    rec = parse_recipe(path.read_text(), env={})
    ctl = Controller(rec, path, run_dir=tmp_path / "run", runtimes={"docker": _Docker()})  # type: ignore[dict-item]
    ctl.token = ctl.reconciler.token = "run-token"
    ctl.reconciler.control = "127.0.0.1:7000"
    ctl.reconciler.build_nodes({})
    nodes = ctl.state.nodes
    return ctl, {name: ctl.reconciler.spec(node) for name, node in nodes.items()}


def test_an_isolated_task_dials_the_gateway_with_its_own_credential(tmp_path: Path) -> None:
    ctl, specs = _specs(tmp_path, "")
    client, server = specs["digits-0"], specs["server-policy"]
    port = ctl.state.nodes["server-policy"].port
    assert client.container is not None and client.container.network == "isolated"
    assert client.container.reach == (7000, port), "the controller's port and its server's"
    assert client.env["JETCTL_CONTROL"] == "172.30.0.1:7000"
    assert client.env["JETCTL_ENDPOINT_OVERRIDE"] == f"policy=172.30.0.1:{port}"
    assert auth.principal(f"Bearer {client.env[TOKEN_ENV]}", "run-token") == auth.Principal(
        node="digits-0", models=frozenset({"policy"}))
    assert server.env[TOKEN_ENV] == "run-token" and server.env["JETCTL_LISTEN_ALSO"] == "172.30.0.1"


def test_network_host_is_the_hosts_network(tmp_path: Path) -> None:
    _, specs = _specs(tmp_path, "    network: host\n")
    client = specs["digits-0"]
    assert client.container is not None and client.container.network == "host"
    assert client.container.reach == ()
    assert client.env["JETCTL_CONTROL"] == "127.0.0.1:7000"
    assert "JETCTL_LISTEN_ALSO" not in specs["server-policy"].env


def test_network_needs_the_docker_runtime() -> None:
    with pytest.raises(RecipeError, match="only applies to runtime: docker"):
        parse_recipe(RECIPE + "    network: host\n", env={})
