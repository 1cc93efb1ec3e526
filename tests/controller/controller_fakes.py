"""Helpers for controller tests: a recipe on disk, a controller whose nodes are fake_node.py."""

from __future__ import annotations

import json
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import yaml

from jetctl.controller.controller import Controller, ControllerOptions, JetctlCommands
from jetctl.recipe import Recipe

FAKE_NODE = Path(__file__).with_name("fake_node.py")
FAST = ControllerOptions(tick_s=0.1, grace_s=5.0, stable_s=30.0, plot_every_s=30.0,
                         probe_s=0.2, probe_timeout_s=1.0)


def recipe_dict(clients: int = 2, **run: Any) -> dict[str, Any]:
    return {
        "run": {"name": "t", "restart_backoff_s": 0.5, "restart_backoff_max_s": 4.0, **run},
        "models": {"policy": {"model": "builtin:tiny"}},
        "tasks": {"arith": {"env": "envs.fake:make_env", "agent": "agents.fake:agent",
                            "model": "policy", "clients": clients}},
    }


def write_recipe(tmp_path: Path, data: dict[str, Any]) -> tuple[Recipe, Path]:
    path = tmp_path / "recipe.yaml"
    path.write_text(yaml.safe_dump(data))
    return Recipe.model_validate(data), path


def fake_commands(recipe_path: Path, run_dir: Path) -> JetctlCommands:
    return JetctlCommands(recipe_path, run_dir.resolve(), prefix=(sys.executable, str(FAKE_NODE)))


def wait_for(cond: Callable[[], Any], timeout_s: float = 20.0, what: str = "condition") -> Any:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        value = cond()
        if value:
            return value
        time.sleep(0.05)
    raise AssertionError(f"timed out after {timeout_s}s waiting for {what}")


def events(run_dir: Path) -> list[tuple[float, str, str, int]]:
    path = run_dir / "fake_events.log"
    if not path.exists():
        return []
    out = []
    for line in path.read_text().splitlines():
        t, name, what, pid = line.split()
        out.append((float(t), name, what, int(pid)))
    return out


def node_states(ctl: Controller) -> dict[str, str]:
    return {n.name: n.state for n in ctl.status().nodes}


class Running:
    """A controller serving in a background thread."""

    def __init__(self, ctl: Controller) -> None:
        self.ctl = ctl
        self.result: list[str] = []
        self.thread = threading.Thread(target=lambda: self.result.append(ctl.serve_forever()))

    def start(self) -> Running:
        self.ctl.setup()
        self.thread.start()
        return self

    def all_running(self) -> bool:
        states = node_states(self.ctl)
        return bool(states) and all(s == "running" for s in states.values())

    def stop(self, grace_s: float = 5.0) -> str:
        self.ctl.request_stop("test", grace_s=grace_s)
        self.thread.join(timeout=grace_s * 2 + 10)
        assert not self.thread.is_alive(), "controller did not finish"
        return self.result[0]


def read_run_json(run_dir: Path) -> dict[str, Any]:
    return json.loads((run_dir / "run.json").read_text())
