"""The per-run bearer token: made by `jetctl up`, stored 0600 in the run dir, sent on every RPC."""

from __future__ import annotations

import os
import secrets
from pathlib import Path

METADATA_KEY = "authorization"


def bearer(token: str) -> tuple[tuple[str, str]]:
    """gRPC call metadata carrying the token."""
    return ((METADATA_KEY, f"Bearer {token}"),)


def new_token() -> str:
    return secrets.token_urlsafe(32)


def write_token(path: Path, token: str) -> None:
    """Write the token readable by its owner only (mode 0600, set before any byte lands)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "w") as f:
        f.write(token)
    os.chmod(path, 0o600)


def read_token(path: Path) -> str:
    return path.read_text().strip()
