"""Who may call what: the run token, per-node credentials, and private files for secrets.

* The run token (`jetctl up` makes it, `<run dir>/token`, mode 0600) is the admin's: every
  call of the controller and of the swarm servers.
* A node credential is what the controller gives each client node it starts (in its
  environment, `JETCTL_TOKEN`; never on a command line). It names the node and the models
  its task trains and is signed with the run token (HMAC-SHA256), so a server checks it
  without asking anyone:

      cred = node_credential(run_token, "arith-0", ["policy"])
      who = principal(f"Bearer {cred}", run_token)   # Principal(node="arith-0", ...)

  It allows the client calls only (`allowed`): Register, Generate, Submit and PullWeights of
  a server whose model is among its models, and the node's own Join, Sync and Rows with the
  controller. Swap, down, scale, run status, a server's Status, and another node's Sync are
  refused (PERMISSION_DENIED), and counted by whoever refuses them. The controller revokes a
  node's credential once the node was drained out of the run (a swap's old nodes): it
  refuses its Join and Sync, and tells the servers at their next sync (`revoked_nodes`).
* `write_private` / `private_key`: a secret file made 0600 with O_EXCL and O_NOFOLLOW (a
  symlink planted where the file goes is refused, not followed), and checked when read.

Left out: expiry (a credential lives as long as its node's name is in the run), and
revocation of a node that is drained without being retired (`down`: the run ends).
"""

from __future__ import annotations

import base64
import hashlib
import hmac
import json
import os
import secrets
import stat
from dataclasses import dataclass
from pathlib import Path

METADATA_KEY = "authorization"
NODE_PREFIX = "jn1"  # a node credential: jn1.<payload>.<mac>
_MAC_CONTEXT = b"jetctl node credential v1\x00"

# the calls a node credential allows: client calls only
SWARM_CLIENT_METHODS = frozenset(
    f"/jetctl.swarm.v1.Swarm/{m}"
    for m in ("Register", "Generate", "Submit", "SubmitStream", "PullWeights")
)
CONTROL_NODE_METHODS = frozenset(f"/jetctl.control.v1.Control/{m}" for m in ("Join", "Sync", "Rows"))


def bearer(token: str) -> tuple[tuple[str, str]]:
    """gRPC call metadata carrying the token."""
    return ((METADATA_KEY, f"Bearer {token}"),)


def new_token() -> str:
    return secrets.token_urlsafe(32)


# -- who is calling -------------------------------------------------------------------------


@dataclass(frozen=True)
class Principal:
    """The caller a valid token names: the admin (the run token) or one client node."""

    node: str | None  # None: the admin
    models: frozenset[str] = frozenset()

    @property
    def admin(self) -> bool:
        return self.node is None

    def may_call(self, method: str, model: str | None = None) -> bool:
        """Whether this caller may call `method` (a gRPC method path) of a swarm server of
        `model` (None: the controller). A node's own-name check of Join/Sync is the
        controller's (the name is in the request)."""
        if self.admin:
            return True
        if model is not None:
            return method in SWARM_CLIENT_METHODS and model in self.models
        return method in CONTROL_NODE_METHODS


ADMIN = Principal(node=None)


def _mac(run_token: str, payload: str) -> str:
    return hmac.new(run_token.encode(), _MAC_CONTEXT + payload.encode(), hashlib.sha256).hexdigest()


def node_credential(run_token: str, node: str, models: list[str] | tuple[str, ...]) -> str:
    """The credential of client node `node` of a task training `models`."""
    body = json.dumps({"n": node, "m": sorted(models)}, separators=(",", ":"))
    payload = base64.urlsafe_b64encode(body.encode()).decode().rstrip("=")
    return f"{NODE_PREFIX}.{payload}.{_mac(run_token, payload)}"


def principal(header: str | bytes, run_token: str) -> Principal | None:
    """Who `authorization: <header>` names, or None when it is no valid token of this run.
    Constant time in the token's bytes: how long a refusal takes says nothing of it."""
    raw = header if isinstance(header, bytes) else header.encode("utf-8", "surrogateescape")
    if hmac.compare_digest(raw, f"Bearer {run_token}".encode()):
        return ADMIN
    if not raw.startswith(f"Bearer {NODE_PREFIX}.".encode()):
        return None
    try:
        _, payload, mac = raw.decode().removeprefix("Bearer ").split(".")
    except (UnicodeDecodeError, ValueError):
        return None
    if not hmac.compare_digest(mac.encode(), _mac(run_token, payload).encode()):
        return None
    try:
        body = json.loads(base64.urlsafe_b64decode(payload + "=" * (-len(payload) % 4)))
        return Principal(node=str(body["n"]), models=frozenset(str(m) for m in body["m"]))
    except (ValueError, KeyError, TypeError):
        return None


def metadata_principal(metadata: object, run_token: str) -> Principal | None:
    """`principal` of a call's invocation metadata (a sequence of (key, value))."""
    for key, value in metadata or ():  # type: ignore[attr-defined]
        if key == METADATA_KEY:
            return principal(value, run_token)
    return None


# -- secret files ---------------------------------------------------------------------------


def write_private(path: Path, data: bytes, *, replace: bool = True) -> None:
    """Write a secret readable by its owner only: created 0600 before any byte lands, with
    O_EXCL and O_NOFOLLOW (a planted symlink is refused, not followed). `replace`: an existing
    file of ours is removed first (never a symlink's target); else FileExistsError."""
    path.parent.mkdir(parents=True, exist_ok=True)
    if replace and os.path.lexists(path):
        os.unlink(path)
    flags = os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW
    fd = os.open(path, flags, 0o600)
    with os.fdopen(fd, "wb") as f:
        f.write(data)


def read_private(path: Path) -> bytes:
    """A secret written by `write_private`: refused when it is a symlink, not a regular file,
    another user's, or readable by anyone but its owner (the message says how to fix it)."""
    fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW)
    with os.fdopen(fd, "rb") as f:
        st = os.fstat(f.fileno())
        if not stat.S_ISREG(st.st_mode):
            raise PermissionError(f"{path} is not a regular file")
        if st.st_uid != os.geteuid():
            raise PermissionError(f"{path} belongs to uid {st.st_uid}, not to this user")
        if st.st_mode & 0o077:
            raise PermissionError(
                f"{path} has mode {stat.S_IMODE(st.st_mode):o}: others may read it; "
                f"`chmod 600 {path}` if it is still secret, else remove it"
            )
        return f.read()


def private_key(path: Path, size: int = 32) -> bytes:
    """The random key in `path`, made on first use (`write_private`, never replacing one)."""
    try:
        write_private(path, secrets.token_bytes(size), replace=False)
    except FileExistsError:
        pass  # made earlier (or by a concurrent first use): read it, checked
    key = read_private(path)
    if len(key) != size:
        raise PermissionError(f"{path} holds {len(key)} bytes, not a {size}-byte key")
    return key


def write_token(path: Path, token: str) -> None:
    """Write the run token readable by its owner only (`write_private`)."""
    write_private(path, token.encode())


def read_token(path: Path) -> str:
    return path.read_text().strip()
