"""The test hosts: reachable from each other over the test's own links, cut and healed on
demand, and nothing left behind (no namespace, no link in the machine's own namespace)."""

from __future__ import annotations

import subprocess
import sys

import pytest

from tests.multihost.netns import Hosts, need_netns

pytestmark = [pytest.mark.integration, pytest.mark.multihost]

CONNECT = "import socket, sys; socket.create_connection((sys.argv[1], 9), timeout=2)"


def reaches(hosts: Hosts, src: str, dst: str) -> bool:
    # a refused connection still proves the route: port 9 listens nowhere
    res = hosts.run(src, [sys.executable, "-c", CONNECT, hosts.addr(dst)], timeout=30)
    return res.returncode == 0 or "Connection refused" in res.stderr


def test_hosts_reach_each_other_until_cut_and_leave_nothing_behind() -> None:
    need_netns()
    with Hosts(["a", "b"]) as hosts:
        assert reaches(hosts, "a", "b") and reaches(hosts, "b", "a")
        hosts.cut("b")
        assert not reaches(hosts, "a", "b")
        hosts.heal("b")
        assert reaches(hosts, "a", "b")
        names = [hosts.ns(n) for n in ("a", "b", "hub")]
        prefix = hosts.prefix
        # the machine's own namespace never had a link of the test
        links = subprocess.run(["ip", "link"], check=True, capture_output=True, text=True)
        assert prefix not in links.stdout
    listed = subprocess.run(["ip", "netns", "list"], check=True, capture_output=True, text=True)
    assert not any(n in listed.stdout for n in names)
