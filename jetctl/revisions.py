"""Client revisions a server refuses: its own copy, one small file in its run dir.

`jetctl swap-clients --drop-old` makes the controller refuse the old revision: it keeps the
set in run.json (`refused`) and sends it to the model's server in every sync reply
(jetctl.controller.hub). The server refuses Submit of those revisions with the `REVISION`
ack and says so in Register, echoes the set it enforces in its syncs (how the controller
knows it took effect), and keeps it in `<its run_dir>/refused/<model>.json` (atomic
replace), so that after a restart it refuses them again before the controller answers. A
server without a controller reads that file on every tick instead.

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
