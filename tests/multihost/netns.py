"""Hosts for multi-host tests: Linux network namespaces on veth links the test makes itself.

    with Hosts(["ctl", "srv", "c1"]) as hosts:
        proc = hosts.spawn("srv", [...], log=path)     # a process "on" host srv
        hosts.addr("srv")                              # 10.<a>.<b>.2
        hosts.cut("c1"); ...; hosts.heal("c1")         # its link down, then up again

Each host is a namespace `<prefix>-<name>` with loopback and one veth `eth0` whose peer sits
on a bridge in a hub namespace `<prefix>-hub`: the hosts reach each other and nothing else
(the root namespace gets no address, no route, no link). The subnet is made from the pid, so
two test runs at once never share one. Leaving (also on failure) kills every process in the
namespaces and deletes them, which removes the links.

Needs root and `ip` (iproute2).
"""

from __future__ import annotations

import os
import shutil
import subprocess
from collections.abc import Sequence
from pathlib import Path
from types import TracebackType
from typing import IO, Self

import pytest


def netns_problem() -> str:
    """Why namespaces cannot be made here ('' when they can)."""
    if os.geteuid() != 0:
        return "network namespaces need root"
    if shutil.which("ip") is None:
        return "the ip command (iproute2) is not installed: apt-get install iproute2"
    return ""


def need_netns() -> None:
    """Skip without root or ip, except under CI=true, where it fails (CI runs as root)."""
    problem = netns_problem()
    if problem:
        if os.environ.get("CI") == "true":
            pytest.fail(f"{problem}; CI runs the multi-host tier as root (scripts/ci-services.sh)")
        pytest.skip(problem)


def _ip(*args: str, ns: str | None = None) -> None:
    argv = ["ip", *(["netns", "exec", ns, "ip"] if ns else []), *args]
    subprocess.run(argv, check=True, capture_output=True, text=True)


class Hosts:
    def __init__(self, names: Sequence[str], prefix: str | None = None) -> None:
        self.names = list(names)
        pid = os.getpid()
        self.prefix = prefix or f"jt{pid % 100000}"
        self.subnet = f"10.{100 + pid % 100}.{pid // 100 % 250}"
        self._procs: list[subprocess.Popen[bytes]] = []

    def ns(self, name: str) -> str:
        # an unknown host fails here, not later as a command that "failed" in no namespace
        if name != "hub" and name not in self.names:
            raise ValueError(f"no host {name!r} here: the hosts are {self.names}")
        return f"{self.prefix}-{name}"

    def addr(self, name: str) -> str:
        return f"{self.subnet}.{self.names.index(name) + 2}"

    def __enter__(self) -> Self:
        try:
            hub = self.ns("hub")
            _ip("netns", "add", hub)
            _ip("link", "set", "lo", "up", ns=hub)
            _ip("link", "add", "br0", "type", "bridge", ns=hub)
            _ip("link", "set", "br0", "up", ns=hub)
            for i, name in enumerate(self.names):
                ns, inner, outer = self.ns(name), f"{self.prefix}i{i}", f"{self.prefix}o{i}"
                _ip("netns", "add", ns)
                _ip("link", "set", "lo", "up", ns=ns)
                # made in the hub, one end moved to the host: the root namespace never has it
                _ip("link", "add", inner, "type", "veth", "peer", "name", outer, ns=hub)
                _ip("link", "set", inner, "netns", ns, ns=hub)
                _ip("link", "set", inner, "name", "eth0", ns=ns)
                _ip("addr", "add", f"{self.addr(name)}/24", "dev", "eth0", ns=ns)
                _ip("link", "set", "eth0", "up", ns=ns)
                _ip("link", "set", outer, "master", "br0", ns=hub)
                _ip("link", "set", outer, "up", ns=hub)
        except BaseException:
            self.close()
            raise
        return self

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.close()

    def spawn(
        self, name: str, argv: Sequence[str], *, log: Path, env: dict[str, str] | None = None,
        cwd: Path | None = None,
    ) -> subprocess.Popen[bytes]:
        """Start `argv` in host `name`'s namespace, output to `log`."""
        log.parent.mkdir(parents=True, exist_ok=True)
        out: IO[bytes] = open(log, "ab")  # noqa: SIM115  # closed with the process
        proc = subprocess.Popen(
            ["ip", "netns", "exec", self.ns(name), *argv], stdout=out,
            stderr=subprocess.STDOUT, env=env, cwd=cwd, start_new_session=True,
        )
        out.close()
        self._procs.append(proc)
        return proc

    def run(self, name: str, argv: Sequence[str], **kwargs: object) -> subprocess.CompletedProcess[str]:
        """Run `argv` in host `name` to completion."""
        return subprocess.run(  # type: ignore[call-overload]
            ["ip", "netns", "exec", self.ns(name), *argv], check=False, text=True,
            capture_output=True, **kwargs,
        )

    def _outer(self, name: str) -> str:
        return f"{self.prefix}o{self.names.index(name)}"

    def cut(self, name: str) -> None:
        """Host `name` loses its link (the hub side goes down): nothing in or out."""
        _ip("link", "set", self._outer(name), "down", ns=self.ns("hub"))

    def heal(self, name: str) -> None:
        _ip("link", "set", self._outer(name), "up", ns=self.ns("hub"))

    def pids(self, name: str) -> list[int]:
        res = subprocess.run(["ip", "netns", "pids", self.ns(name)], check=False,
                             capture_output=True, text=True)
        return [int(p) for p in res.stdout.split()]

    def close(self) -> None:
        """Kill everything in the namespaces (ours, and what it started: Ray's daemons),
        then delete them and with them the links."""
        for proc in self._procs:
            if proc.poll() is None:
                proc.kill()
        for name in [*self.names, "hub"]:
            for pid in self.pids(name):
                try:
                    os.kill(pid, 9)
                except ProcessLookupError:
                    pass
        for proc in self._procs:
            try:
                proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                pass
        for name in [*self.names, "hub"]:
            subprocess.run(["ip", "netns", "del", self.ns(name)], check=False, capture_output=True)
