"""Fixtures for controller tests: a run dir that is cleaned up, controllers with fake nodes."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

from jetctl.controller.controller import Controller, ControllerOptions
from jetctl.controller.runtimes.process import ProcessRuntime
from tests.controller.controller_fakes import (
    FAST,
    Running,
    fake_commands,
    recipe_dict,
    write_recipe,
)


@pytest.fixture
def run_dir(tmp_path: Path) -> Iterator[Path]:
    d = tmp_path / "runs" / "t"
    yield d
    # whatever a failing test left behind: kill it
    rt = ProcessRuntime(d)
    for h in rt.list():
        rt.kill(h)


@pytest.fixture
def make_controller(tmp_path: Path, run_dir: Path) -> Iterator[Callable[..., Running]]:
    made: list[Running] = []

    def make(data: dict[str, Any] | None = None, resume: bool = False,
             options: ControllerOptions = FAST) -> Running:
        recipe, path = write_recipe(tmp_path, data or recipe_dict())
        ctl = Controller(recipe, path, run_dir=run_dir, resume=resume,
                         commands=fake_commands(path, run_dir),
                         latest_link=tmp_path / "runs" / "latest", options=options)
        r = Running(ctl)
        made.append(r)
        return r

    yield make
    for r in made:
        if r.thread.is_alive():
            r.stop(grace_s=1.0)


