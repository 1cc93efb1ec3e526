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

from collections.abc import Iterable
from pathlib import Path

from jetctl.rundir import RunPaths, read_json, write_json_atomic


def read_refused(run_dir: Path, model: str) -> frozenset[str]:
    """The entries the controller asks `model`'s server to refuse (empty when none)."""
    data = read_json(RunPaths(Path(run_dir)).refused_file(model)) or {}
    return frozenset(str(r) for r in data.get("revisions") or ())


def write_refused(run_dir: Path, model: str, entries: Iterable[str]) -> None:
    write_json_atomic(
        RunPaths(Path(run_dir)).refused_file(model),
        {"model": model, "revisions": sorted(set(entries))},
    )
