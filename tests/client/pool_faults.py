"""Preloaded into a rollout forkserver by test_rollout_pool.py: while the file named by
`JETCTL_TEST_FAIL_FORK` exists, the forkserver's fork fails with EAGAIN (what a container's
pids limit does while a fork bomb holds every pid); the file is removed by the first fork it
fails. Also the env and agents of those rollouts."""

from __future__ import annotations

import errno
import os
import random
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from jetctl.env import LLM, Task

FLAG_ENV = "JETCTL_TEST_FAIL_FORK"
_real_fork = os.fork


def _fork() -> int:
    flag = os.environ.get(FLAG_ENV, "")
    if flag and os.path.exists(flag):
        os.unlink(flag)
        raise BlockingIOError(errno.EAGAIN, os.strerror(errno.EAGAIN))
    return _real_fork()


if os.environ.get(FLAG_ENV) and "multiprocessing.forkserver" in __import__("sys").modules:
    os.fork = _fork  # only in the forkserver, which imports this as a preload


class _Session:
    def __init__(self, task: Task) -> None:
        self.task = task

    def reward(self) -> float:
        return 1.0

    def close(self) -> None:
        pass


class _Env:
    def tasks(self, rng: random.Random) -> Iterator[Task]:
        while True:
            yield Task(id=str(rng.random()), prompt="")

    def open(self, task: Task) -> _Session:
        return _Session(task)


def make_env() -> _Env:
    return _Env()


def calm_agent(task: Task, llm: LLM, session: Any) -> None:
    pass


def bomb_agent(task: Task, llm: LLM, session: Any) -> None:
    """Leaves the forkserver unable to fork its next rollout."""
    Path(os.environ[FLAG_ENV]).touch()


def preloaded_agent(task: Task, llm: LLM, session: Any) -> None:
    """Fails unless the forkserver already loaded tests.client.soft_preload (inherited by
    fork: nothing in the rollout imports it)."""
    import sys

    if "tests.client.soft_preload" not in sys.modules:
        raise AssertionError("tests.client.soft_preload was not preloaded")
