"""Fault injection for the chaos tests and `jetctl chaos` (everything here is off unless asked).

Faults are `name:value` pairs, comma-separated, read from two places:

* `JETCTL_FAULTS` (environment): fixed for the life of the process, e.g. `drop_ack:0.3`;
* the file named by `JETCTL_FAULTS_FILE`: re-read when it changes, so a chaos schedule can
  switch faults on and off in servers it started long ago (the file wins on a clash).

The faults a server knows:

* `drop_ack:P`         commit a Submit, then with probability P answer UNAVAILABLE instead of
                       the reply (the reply is lost after the commit; the client resends and
                       must hear DUPLICATE, and the group must be trained once);
* `stall_checkpoint:S` sleep S seconds between a checkpoint's files and its manifest: a
  window in which a kill -9 lands mid-checkpoint.

`JETCTL_ENDPOINT_OVERRIDE=model=host:port[,model=host:port]` points client nodes at another
address for a model's server (the chaos network proxy, `jetctl.netproxy`) instead of the
endpoint in `servers/<model>.json`.
"""

from __future__ import annotations

import logging
import os
import random
import threading
import time
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

import grpc

from jetctl.rundir import write_text_atomic

log = logging.getLogger("jetctl.faults")

FAULTS_ENV = "JETCTL_FAULTS"
FAULTS_FILE_ENV = "JETCTL_FAULTS_FILE"
ENDPOINT_OVERRIDE_ENV = "JETCTL_ENDPOINT_OVERRIDE"
KNOWN = ("drop_ack", "stall_checkpoint")


def parse(spec: str) -> dict[str, float]:
    """`drop_ack:0.3,stall_checkpoint:2` -> {"drop_ack": 0.3, "stall_checkpoint": 2.0}."""
    out: dict[str, float] = {}
    for part in spec.replace("\n", ",").split(","):
        part = part.strip()
        if not part:
            continue
        name, sep, value = part.partition(":")
        if not sep or name not in KNOWN:
            raise ValueError(
                f"fault {part!r} is not name:value with name one of {', '.join(KNOWN)}"
            )
        out[name] = float(value)
    return out


def format_faults(faults: dict[str, float]) -> str:
    return ",".join(f"{k}:{v:g}" for k, v in sorted(faults.items()) if v)


class Faults:
    """The faults in force for this process (see the module docstring)."""

    def __init__(self, static: str = "", path: Path | None = None, seed: int | None = None) -> None:
        self._static = parse(static)
        self._path = path
        self._from_file: dict[str, float] = {}
        self._mtime = 0.0
        self._checked = 0.0
        self._lock = threading.Lock()
        self._rng = random.Random(seed)
        self.injected: dict[str, int] = {}

    @property
    def configured(self) -> bool:
        """Whether any fault can ever fire here (a spec, or a file that may be written)."""
        return bool(self._static) or self._path is not None

    @classmethod
    def from_env(cls) -> Faults:
        path = os.environ.get(FAULTS_FILE_ENV)
        return cls(os.environ.get(FAULTS_ENV, ""), Path(path) if path else None)

    def value(self, name: str) -> float:
        """The fault's value now (0 when off)."""
        with self._lock:
            self._refresh()
            return self._from_file.get(name, self._static.get(name, 0.0))

    def roll(self, name: str) -> bool:
        """True with the probability the fault `name` is set to."""
        p = self.value(name)
        if p <= 0:
            return False
        with self._lock:
            hit = self._rng.random() < p
            if hit:
                self.injected[name] = self.injected.get(name, 0) + 1
        return hit

    def pause(self, name: str) -> None:
        """Sleep as many seconds as the fault `name` says (stall_checkpoint)."""
        seconds = self.value(name)
        if seconds > 0:
            log.warning("fault %s: sleeping %.1fs", name, seconds)
            self.injected[name] = self.injected.get(name, 0) + 1
            time.sleep(seconds)

    def _refresh(self) -> None:
        if self._path is None or time.monotonic() - self._checked < 0.25:
            return
        self._checked = time.monotonic()
        try:
            mtime = self._path.stat().st_mtime
        except FileNotFoundError:
            self._from_file = {}
            return
        if mtime != self._mtime:
            self._mtime = mtime
            try:
                self._from_file = parse(self._path.read_text())
            except ValueError as e:
                log.error("ignoring %s: %s", self._path, e)


def write_faults_file(path: Path, faults: dict[str, float]) -> None:
    """Atomically set the faults that `Faults` instances reading `path` apply."""
    write_text_atomic(path, format_faults(faults) + "\n")


def drop_ack_interceptor(faults: Faults) -> grpc.aio.ServerInterceptor:
    """Wrap Submit: the reply is computed (the groups are committed), then maybe dropped."""

    class _DropAck(grpc.aio.ServerInterceptor):
        async def intercept_service(
            self,
            continuation: Callable[[grpc.HandlerCallDetails], Awaitable[grpc.RpcMethodHandler]],
            details: grpc.HandlerCallDetails,
        ) -> grpc.RpcMethodHandler:
            handler = await continuation(details)
            if not details.method.endswith("/Submit") or handler is None or not handler.unary_unary:
                return handler
            inner = handler.unary_unary

            async def submit(request: Any, context: grpc.aio.ServicerContext) -> Any:
                reply = await inner(request, context)
                if faults.roll("drop_ack"):
                    n = faults.injected.get("drop_ack", 0)
                    log.warning("fault drop_ack: reply to a committed Submit dropped (%d so far)", n)
                    await context.abort(
                        grpc.StatusCode.UNAVAILABLE, "fault injected: reply dropped after commit"
                    )
                return reply

            return grpc.unary_unary_rpc_method_handler(
                submit,
                request_deserializer=handler.request_deserializer,
                response_serializer=handler.response_serializer,
            )

    return _DropAck()


def endpoint_override(model: str) -> str | None:
    """The address `JETCTL_ENDPOINT_OVERRIDE` gives for `model` (None: use servers/<m>.json)."""
    raw = os.environ.get(ENDPOINT_OVERRIDE_ENV, "")
    for part in raw.split(","):
        name, sep, endpoint = part.strip().partition("=")
        if sep and name == model and endpoint:
            return endpoint
    return None
