"""An env wrapper that makes every environment answer take `latency_s` seconds.

    env_args: {inner: envs.arithmetic:make_env, latency_s: 2.0, inner_args: {max_turns: 1}}

`jetctl bench loop --env-latency` wraps a recipe's env with it to stand in for a slow
environment (a browser page load, a test suite, a rate-limited API): every call of a
session method other than `reward` and `close` sleeps `latency_s` before it answers, in
the rollout that made it. Sessions, tasks and rewards are otherwise the inner env's own.

This module stays light (stdlib only): rollout processes import it.
"""

from __future__ import annotations

import functools
import importlib
import random
import time
from collections.abc import Iterator
from typing import Any

from jetctl.env import Task

UNTIMED = frozenset({"reward", "close"})


class SlowSession:
    """The inner session, with `latency_s` added to every call but reward() and close()."""

    def __init__(self, inner: Any, latency_s: float) -> None:
        self._inner = inner
        self._latency_s = latency_s

    def __getattr__(self, name: str) -> Any:
        value = getattr(self._inner, name)
        if name.startswith("_") or name in UNTIMED or not callable(value):
            return value

        @functools.wraps(value)
        def slow(*args: Any, **kwargs: Any) -> Any:
            time.sleep(self._latency_s)
            return value(*args, **kwargs)

        return slow


class SlowEnv:
    def __init__(self, inner: Any, latency_s: float) -> None:
        self.inner = inner
        self.latency_s = latency_s
        self.name = f"{getattr(inner, 'name', 'env')}+{latency_s:g}s"

    def tasks(self, rng: random.Random) -> Iterator[Task]:
        tasks: Iterator[Task] = self.inner.tasks(rng)
        return tasks

    def open(self, task: Task) -> SlowSession:
        return SlowSession(self.inner.open(task), self.latency_s)


def make_env(inner: str, latency_s: float, inner_args: dict[str, Any] | None = None) -> SlowEnv:
    """Wrap the env made by `inner` (module:function) with `inner_args`."""
    if latency_s < 0:
        raise ValueError(f"latency_s ({latency_s}) must be >= 0")
    module, sep, attr = inner.partition(":")
    if not sep:
        raise ValueError(f"inner {inner!r} is not of the form module:function")
    factory = getattr(importlib.import_module(module), attr)
    return SlowEnv(factory(**(inner_args or {})), latency_s)
