"""The run directory: where each file lives (docs/CONTRACTS.md), atomic writes, the token,
finding a run.

One module owns these facts; the controller, the server, the client node, chaos, the ledger
and the CLI import it (it imports nothing of theirs):

    paths = RunPaths(Path("runs/tiny"))
    paths.store("policy")              # runs/tiny/server-policy/store.sqlite
    write_json_atomic(paths.server_file("policy"), {...})
    token = read_token_for(paths.root)  # $JETCTL_TOKEN, else runs/tiny/token

Every `jetctl` command that acts on a run (`status`, `down`, `up --resume`) finds it with
`find_run_dir`: `--run-dir` if given, else `runs/latest`, else the newest `runs/*/run.json`.
"""

from __future__ import annotations

import json
import os
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from jetctl import auth

TOKEN_ENV = "JETCTL_TOKEN"


class RunDirError(Exception):
    """A run dir problem the user can fix (no run, no token, a controller already running)."""


@dataclass(frozen=True)
class RunPaths:
    """The files of one run dir (docs/CONTRACTS.md)."""

    root: Path

    # -- the controller's ------------------------------------------------------------------

    @property
    def run_json(self) -> Path:
        return self.root / "run.json"

    @property
    def token(self) -> Path:
        return self.root / "token"

    @property
    def tls(self) -> Path:
        """The run's certificates when `run.tls.cert_dir` is null (jetctl.tls)."""
        return self.root / "tls"

    @property
    def logs(self) -> Path:
        return self.root / "logs"

    @property
    def pids(self) -> Path:
        return self.root / "pids"

    @property
    def controller_log(self) -> Path:
        return self.logs / "controller.log"

    def log(self, node: str) -> Path:
        return self.logs / f"{node}.log"

    def json_log(self, process: str) -> Path:
        """`process`'s structured log lines, one JSON object each (jetctl.logs)."""
        return self.logs / f"{process}.jsonl"

    def pid_file(self, node: str) -> Path:
        return self.pids / f"{node}.pid"

    @property
    def reward_curve_csv(self) -> Path:
        return self.root / "reward_curve.csv"

    @property
    def reward_curve_png(self) -> Path:
        return self.root / "reward_curve.png"

    @property
    def reward_by_task_csv(self) -> Path:
        return self.root / "reward_by_task.csv"

    @property
    def reward_by_task_png(self) -> Path:
        return self.root / "reward_by_task.png"

    @property
    def refused(self) -> Path:
        return self.root / "refused"

    def refused_file(self, model: str) -> Path:
        """The revisions `model`'s server refuses (jetctl.revisions)."""
        return self.refused / f"{model}.json"

    @property
    def received(self) -> Path:
        """What the controller received of every node's ledger journal
        (jetctl.controller.received); the ledger is built from it."""
        return self.root / "received.sqlite"

    @property
    def rows(self) -> Path:
        """Each dataset task's epoch, position and leases across its nodes
        (jetctl.controller.rows); kept across `up --resume`."""
        return self.root / "rows.json"

    @property
    def eval_dir(self) -> Path:
        """`jetctl eval`'s figures of each checkpoint (jetctl.eval; a task's in-run eval,
        jetctl.server.evals, runs it too), read by the export's model card and by
        `jetctl status`."""
        return self.root / "eval"

    def eval_results(self, step: int, split: str) -> Path:
        return self.eval_dir / f"step-{step}.{split}.json"

    def eval_result_files(self) -> list[tuple[int, str, Path]]:
        """Every `eval_results` file there is: (step, split, path), by step."""
        found = []
        for path in self.eval_dir.glob("step-*.json") if self.eval_dir.is_dir() else []:
            step, _, split = path.name.removesuffix(".json").removeprefix("step-").partition(".")
            if step.isdigit() and split:
                found.append((int(step), split, path))
        return sorted(found)

    @property
    def faults(self) -> Path:
        """The faults in force during a chaos run (jetctl.faults)."""
        return self.root / "faults"

    # -- the servers' ----------------------------------------------------------------------

    @property
    def servers(self) -> Path:
        return self.root / "servers"

    def server_file(self, model: str) -> Path:
        return self.servers / f"{model}.json"

    def server_dir(self, model: str) -> Path:
        return self.root / f"server-{model}"

    def server_phase(self, model: str) -> Path:
        """What `model`'s server process is doing while it starts (jetctl.server.app)."""
        return self.server_dir(model) / "phase.json"

    def store(self, model: str) -> Path:
        """`model`'s trajectory store (jetctl.server.store)."""
        return self.server_dir(model) / "store.sqlite"

    def stores(self) -> dict[str, Path]:
        """model -> store of every server that ever ran in this dir."""
        return {
            p.parent.name.removeprefix("server-"): p
            for p in sorted(self.root.glob("server-*/store.sqlite"))
        }

    def checkpoints(self, model: str) -> Path:
        """Where `model`'s checkpoints go when `checkpoint.dir` is null."""
        return self.root / "checkpoints" / model

    @property
    def metrics(self) -> Path:
        return self.root / "metrics"

    def steps_log(self, model: str) -> Path:
        """One JSON line per optimizer step of `model` (the reward curve reads these)."""
        return self.metrics / f"{model}.steps.jsonl"

    # -- the client nodes' -----------------------------------------------------------------

    @property
    def nodes(self) -> Path:
        return self.root / "nodes"

    def node_file(self, node: str) -> Path:
        return self.nodes / f"{node}.json"

    @property
    def spool_dir(self) -> Path:
        return self.root / "spool"

    def spool(self, node: str) -> Path:
        """`node`'s spool (jetctl.client.spool)."""
        return self.spool_dir / f"{node}.sqlite"

    def spools(self) -> dict[str, Path]:
        """node -> spool of every client node that ever ran in this dir (a container's in
        its own folder)."""
        found = [*self.spool_dir.glob("*.sqlite"), *self.containers.glob("*/spool/*.sqlite")]
        return {p.stem: p for p in sorted(found)}

    @property
    def containers(self) -> Path:
        return self.root / "containers"

    def container_spool(self, node: str) -> Path:
        """The folder a client container (runtime: docker) sees as `spool/`: its own only,
        so it never reads or rewrites another node's spool."""
        return self.containers / node / "spool"

    def rollouts(self, node: str) -> Path:
        """`node`'s live rollouts (pid, start time): a restart kills what a killed
        predecessor left (jetctl.client.rollout)."""
        return self.spool_dir / f"{node}.rollouts"

    def make(self) -> None:
        for d in (self.root, self.logs, self.pids, self.servers, self.nodes, self.metrics):
            d.mkdir(parents=True, exist_ok=True)


# -- atomic writes ------------------------------------------------------------------------


@contextmanager
def replacing(path: Path) -> Iterator[Path]:
    """A temporary path beside `path`, renamed over it when the block ends without error:
    a reader never sees half a file. The name is unique per process and thread, so two
    writers of one file never rename each other's temporary away."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.{threading.get_ident()}.tmp")
    try:
        yield tmp
        os.replace(tmp, path)
    finally:
        tmp.unlink(missing_ok=True)


def write_text_atomic(path: Path, text: str) -> None:
    with replacing(path) as tmp:
        tmp.write_text(text)


def write_json_atomic(path: Path, data: dict[str, Any]) -> None:
    write_text_atomic(path, json.dumps(data, indent=1) + "\n")


def read_json(path: Path) -> dict[str, Any] | None:
    """The JSON object in `path`, or None when it is missing or not (yet) valid."""
    try:
        data = json.loads(Path(path).read_text())
    except (OSError, ValueError):
        return None
    return data if isinstance(data, dict) else None


# -- the token ----------------------------------------------------------------------------


def resolve_token(paths: RunPaths, recipe_token: str | None, create: bool) -> str:
    """The run's token as `jetctl up` settles it: env JETCTL_TOKEN, else the recipe's
    `run.token`, else the token file, else (create=True) a new one. It is (re)written to
    the token file, mode 0600."""
    token = os.environ.get(TOKEN_ENV) or recipe_token
    if not token and paths.token.is_file():
        token = auth.read_token(paths.token)
    if not token:
        if not create:
            raise RunDirError(f"{paths.token} is missing: set {TOKEN_ENV} to the run's token")
        token = auth.new_token()
    if not paths.token.is_file() or auth.read_token(paths.token) != token:
        auth.write_token(paths.token, token)
    return token


def read_token_for(run_dir: Path) -> str:
    """The token a node or command uses to reach a run: env JETCTL_TOKEN, else the token
    file (`jetctl up` writes it). Raises RunDirError naming both."""
    token = os.environ.get(TOKEN_ENV)
    if token:
        return token
    path = RunPaths(Path(run_dir)).token
    if not path.is_file():
        raise RunDirError(f"no token: set {TOKEN_ENV} or create {path} (jetctl up writes it)")
    return auth.read_token(path)


# -- finding a run ------------------------------------------------------------------------


def read_run_json(run_dir: Path) -> dict[str, Any]:
    data = read_json(RunPaths(run_dir).run_json)
    if data is None:
        raise RunDirError(f"{run_dir} has no readable run.json: is it a jetctl run dir?")
    return data


def find_run_dir(run_dir: Path | None, runs_root: Path = Path("runs")) -> Path:
    """`run_dir` if given, else `runs/latest`, else the newest `runs/*/run.json`."""
    if run_dir is not None:
        if not RunPaths(run_dir).run_json.is_file():
            raise RunDirError(f"{run_dir} has no run.json: pass the dir `jetctl up` made")
        return run_dir.resolve()
    latest = runs_root / "latest"
    if RunPaths(latest).run_json.is_file():
        return latest.resolve()
    candidates = sorted(runs_root.glob("*/run.json"), key=lambda p: p.stat().st_mtime)
    if candidates:
        return candidates[-1].parent.resolve()
    raise RunDirError(
        f"no run found under {runs_root}/: start one with `jetctl up RECIPE` or pass --run-dir"
    )


def update_latest_link(link: Path, run_dir: Path) -> None:
    """Point `link` (e.g. runs/latest) at `run_dir`, replacing it atomically."""
    link.parent.mkdir(parents=True, exist_ok=True)
    run_dir = run_dir.resolve()
    target: str = (
        run_dir.name if run_dir.parent == link.parent.resolve() else str(run_dir)
    )
    if link.exists() and not link.is_symlink():
        return  # a real dir named `latest`: leave the user's files alone
    with replacing(link) as tmp:
        tmp.unlink(missing_ok=True)
        os.symlink(target, tmp)
