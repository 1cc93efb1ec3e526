"""Addresses: a free port, where to connect to something bound to a host, and which address
of this host to advertise to peers on other hosts."""

from __future__ import annotations

import os
import socket

WILDCARDS = ("0.0.0.0", "", "::")


def free_port(host: str = "127.0.0.1") -> int:
    """A port nothing listens on now (the OS picks it)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((host, 0))
        return int(s.getsockname()[1])


def connect_host(host: str) -> str:
    """Where to connect to a server bound to `host` (a wildcard bind is reached on loopback)."""
    return "127.0.0.1" if host in WILDCARDS else host


def route_address(target: str) -> str:
    """This host's address on its route to `target` (host or host:port): what a peer there
    sees us as. No packet is sent (a UDP socket's connect only picks the route)."""
    host = target.rsplit(":", 1)[0] if target.count(":") == 1 else target
    host = host.strip("[]") or "127.0.0.1"
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    try:
        with socket.socket(family, socket.SOCK_DGRAM) as s:
            s.connect((host, 9))
            return str(s.getsockname()[0])
    except OSError:
        return "127.0.0.1"


def advertised_host(bind: str, advertise: str | None, peer: str = "") -> str:
    """The address others dial to reach something bound to `bind`: `advertise` when given;
    else `bind` unless it is a wildcard; else this host's address on its route to `peer`
    (the controller), or loopback without one."""
    if advertise:
        return advertise
    if bind not in WILDCARDS:
        return bind
    return route_address(peer) if peer else "127.0.0.1"


# addresses a server binds besides its own host: the gateway of the run's docker network,
# so that client containers reach it there (the controller sets it, runtimes/docker.py)
LISTEN_ALSO_ENV = "JETCTL_LISTEN_ALSO"


def listen_also(bind: str) -> list[str]:
    """The extra addresses `LISTEN_ALSO_ENV` names, none when `bind` is a wildcard already."""
    if bind in WILDCARDS:
        return []
    return [h for h in os.environ.get(LISTEN_ALSO_ENV, "").split(",") if h and h != bind]
