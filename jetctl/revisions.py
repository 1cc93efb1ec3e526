"""Client revisions a server refuses, as the controller tells it: one small file per model.

`jetctl swap-clients --drop-old` makes the controller write `<run_dir>/refused/<model>.json`
(`{"model": M, "revisions": ["web/r0", ...]}`, atomic replace). The server reads it at
start and on every tick (about every 2 s), refuses Submit of those revisions with the
`REVISION` ack and says so in Register, and echoes the set it enforces in
`servers/<model>.json` (`refused_revisions`), which is how the controller knows it took
effect. A file, not an RPC: it outlives a server restart, and needs no new endpoint.

An entry is `<task>/<revision>` (that task's nodes only; revisions are numbered per run,
but every task starts at r0) or a bare revision (every task).
"""

from __future__ import annotations

import json
import os
from collections.abc import Iterable
from pathlib import Path


def refused_path(run_dir: Path, model: str) -> Path:
    return Path(run_dir) / "refused" / f"{model}.json"


def read_refused(run_dir: Path, model: str) -> frozenset[str]:
    """The entries the controller asks `model`'s server to refuse (empty when none)."""
    try:
        data = json.loads(refused_path(run_dir, model).read_text())
    except (OSError, ValueError):
        return frozenset()
    revisions = data.get("revisions") if isinstance(data, dict) else None
    return frozenset(str(r) for r in revisions or ())


def write_refused(run_dir: Path, model: str, entries: Iterable[str]) -> None:
    path = refused_path(run_dir, model)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    tmp.write_text(json.dumps({"model": model, "revisions": sorted(set(entries))}) + "\n")
    os.replace(tmp, path)
