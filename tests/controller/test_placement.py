"""What the ray runtime is asked to place: a bundle per node of the recipe's resources, one
placement group per task revision and per server, the node's command run by the Ray host's
own Python in its work dir, the controller's advertised address in its environment. The
resources that only Ray reads are refused on the other runtimes."""

from __future__ import annotations

import threading
from pathlib import Path

import pytest

from jetctl.controller.reconcile import ControllerOptions, JetctlCommands, Reconciler
from jetctl.controller.runtimes.process import ProcessRuntime
from jetctl.controller.state import RunState
from jetctl.link import CONTROL_ENV
from jetctl.recipe import RecipeError, parse_recipe
from jetctl.rundir import RunPaths

pytestmark = pytest.mark.unit

RECIPE = """
run: {name: t, ray: {address: 10.0.0.5:6379}}
models:
  policy:
    model: builtin:tiny
    runtime: ray
    host: 0.0.0.0
    resources: {cpus: 2, gpus: 1, memory: 8g, custom: {gpu_host: 1}}
tasks:
  web:
    env: envs.digits:make_env
    agent: agents.digits:agent
    model: policy
    clients: 3
    runtime: ray
    resources: {cpus: 0.5, gpus: 0.25, memory: 512m, custom: {cpu_host: 1}}
"""


class FakeRay(ProcessRuntime):
    """Stands in for the ray runtime where only its work dir is read."""

    name = "ray"

    def work_dir(self) -> str:
        return "/srv/jetctl/jetctl-t"


def reconciler(tmp_path: Path) -> Reconciler:
    recipe = parse_recipe(RECIPE, file="r.yaml", env={})
    state = RunState(recipe, tmp_path / "r.yaml", RunPaths(tmp_path / "run"))
    state.endpoint = "10.0.0.5:7000"
    r = Reconciler(
        state, runtime=ProcessRuntime(tmp_path / "run"), runtimes={"ray": FakeRay(tmp_path)},
        commands=JetctlCommands(tmp_path / "r.yaml", tmp_path / "run"),
        container_commands=JetctlCommands(tmp_path / "r.yaml", tmp_path / "run"),
        options=ControllerOptions(), kill_now=threading.Event(),
    )
    r.control, r.token = "127.0.0.1:7000", "tok"
    r.build_nodes({})
    return r


def test_each_client_node_gets_its_bundle_of_the_task_revisions_group(tmp_path: Path) -> None:
    r = reconciler(tmp_path)
    spec = r.spec(r.state.nodes["web-2"])
    p = spec.placement
    assert p is not None and (p.group, p.bundles, p.index) == ("web/r0", 3, 2)
    assert dict(p.resources) == {
        "CPU": 0.5, "GPU": 0.25, "memory": float(512 << 20), "cpu_host": 1.0,
    }
    assert spec.argv[:3] == ["python", "-m", "jetctl.cli.main"], "the Ray host's own Python"
    assert spec.argv[spec.argv.index("--run-dir") + 1] == "/srv/jetctl/jetctl-t"
    # other hosts dial the controller's advertised address, never this host's loopback
    assert spec.env[CONTROL_ENV] == "10.0.0.5:7000"


def test_a_server_gets_a_group_of_its_own_with_its_gpus(tmp_path: Path) -> None:
    r = reconciler(tmp_path)
    node = r.state.nodes["server-policy"]
    assert node.endpoint == "", "a server on Ray says where it is when it syncs"
    p = r.spec(node).placement
    assert p is not None and (p.group, p.bundles, p.index) == ("server/policy", 1, 0)
    assert dict(p.resources) == {
        "CPU": 2.0, "GPU": 1.0, "memory": float(8 << 30), "gpu_host": 1.0,
    }


@pytest.mark.parametrize("where, text", [
    ("tasks", "custom: {cpu_host: 1}"), ("tasks", "gpus: 1"), ("models", "gpus: 1"),
])
def test_ray_resources_are_refused_on_other_runtimes(where: str, text: str) -> None:
    body = RECIPE.replace("runtime: ray\n", "runtime: process\n")
    if where == "tasks":
        body = body.replace("resources: {cpus: 0.5, gpus: 0.25, memory: 512m, custom: {cpu_host: 1}}",
                            f"resources: {{{text}}}")
    with pytest.raises(RecipeError) as caught:
        parse_recipe(body, file="r.yaml", env={})
    assert "only applies to runtime: ray" in caught.value.render()


def test_runtime_ray_needs_the_clusters_address() -> None:
    with pytest.raises(RecipeError) as caught:
        parse_recipe(RECIPE.replace("ray: {address: 10.0.0.5:6379}", "ray: {}"), file="r.yaml",
                     env={})
    assert "run.ray.address = null: is needed by runtime: ray (models.policy, tasks.web)" in (
        caught.value.render())
