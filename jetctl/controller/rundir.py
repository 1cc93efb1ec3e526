"""The run directory: where each file lives (docs/CONTRACTS.md), run.json, the token, finding a run.

Every `jetctl` command that acts on a run (`status`, `down`, `up --resume`) finds it here:
`--run-dir` if given, else `runs/latest`, else the newest `runs/*/run.json`.
"""

from __future__ import annotations

import json
import os
import socket
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import psutil

from jetctl import auth

TOKEN_ENV = "JETCTL_TOKEN"


class RunDirError(Exception):
    """A run dir problem the user can fix (no run, a controller already running, ...)."""


@dataclass(frozen=True)
class RunPaths:
    """The files of one run dir (docs/CONTRACTS.md)."""

    root: Path

    @property
    def run_json(self) -> Path:
        return self.root / "run.json"

    @property
    def token(self) -> Path:
        return self.root / "token"

    @property
    def logs(self) -> Path:
        return self.root / "logs"

    @property
    def pids(self) -> Path:
        return self.root / "pids"

    @property
    def servers(self) -> Path:
        return self.root / "servers"

    @property
    def nodes(self) -> Path:
        return self.root / "nodes"

    @property
    def metrics(self) -> Path:
        return self.root / "metrics"

    @property
    def controller_log(self) -> Path:
        return self.logs / "controller.log"

    def server_file(self, model: str) -> Path:
        return self.servers / f"{model}.json"

    def node_file(self, node: str) -> Path:
        return self.nodes / f"{node}.json"

    def log(self, node: str) -> Path:
        return self.logs / f"{node}.log"

    def make(self) -> None:
        for d in (self.root, self.logs, self.pids, self.servers, self.nodes, self.metrics):
            d.mkdir(parents=True, exist_ok=True)


def write_json_atomic(path: Path, data: dict[str, Any]) -> None:
    """Write, then rename over: a reader never sees half a file."""
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    tmp.write_text(json.dumps(data, indent=2, sort_keys=False) + "\n")
    os.replace(tmp, path)


def read_json(path: Path) -> dict[str, Any] | None:
    """The JSON object in `path`, or None when it is missing or not (yet) valid."""
    try:
        data = json.loads(path.read_text())
    except (OSError, ValueError):
        return None
    return data if isinstance(data, dict) else None


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
    tmp = link.with_name(f".{link.name}.{os.getpid()}.tmp")
    tmp.unlink(missing_ok=True)
    os.symlink(target, tmp)
    os.replace(tmp, link)


def free_port(host: str = "127.0.0.1") -> int:
    """A port nothing listens on now (the OS picks it)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((host, 0))
        return int(s.getsockname()[1])


def connect_host(host: str) -> str:
    """Where to connect to a server bound to `host` (a wildcard bind is reached on loopback)."""
    return "127.0.0.1" if host in ("0.0.0.0", "", "::") else host


def resolve_token(paths: RunPaths, recipe_token: str | None, create: bool) -> str:
    """The run's token: env JETCTL_TOKEN, else the recipe's `run.token`, else the token file,
    else (create=True) a new one. It is (re)written to the token file, mode 0600."""
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
    """The token a command uses to reach a run: env JETCTL_TOKEN, else the token file."""
    token = os.environ.get(TOKEN_ENV)
    if token:
        return token
    path = RunPaths(run_dir).token
    if not path.is_file():
        raise RunDirError(f"{path} is missing: set {TOKEN_ENV} to the run's token")
    return auth.read_token(path)


def pid_alive(pid: int, create_time: float = 0.0) -> bool:
    """The pid runs (and, when create_time is given, is that same process)."""
    if pid <= 0:
        return False
    try:
        p = psutil.Process(pid)
        if p.status() == psutil.STATUS_ZOMBIE:
            return False
        return create_time == 0.0 or abs(p.create_time() - create_time) < 0.05
    except psutil.Error:
        return False


def process_create_time(pid: int) -> float:
    try:
        return float(psutil.Process(pid).create_time())
    except psutil.Error:
        return 0.0
