"""A real `jetctl server` process on loopback for the benchmarks (`bench ingest`, `bench pull`).

    with BenchServer(recipe_yaml, train=False) as server:
        server.endpoint, server.token, server.cpu_seconds()

The recipe's first model is served from a temporary run directory; the server is stopped
(SIGTERM, then SIGKILL) when the block ends.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from types import TracebackType
from typing import Self

import psutil

from jetctl.auth import write_token
from jetctl.net import free_port
from jetctl.rundir import RunPaths

TOKEN = "bench"
START_TIMEOUT_S = 300.0


class BenchError(RuntimeError):
    """The benchmark's server did not come up (its log is in the message)."""


class BenchServer:
    def __init__(self, recipe_yaml: str, *, model: str = "policy", train: bool = False) -> None:
        self._recipe = recipe_yaml
        self.model = model
        self._train = train
        self._tmp = tempfile.TemporaryDirectory(prefix="jetctl-bench-")
        self.run_dir = Path(self._tmp.name)
        self.paths = RunPaths(self.run_dir)
        self.token = TOKEN
        self.endpoint = ""
        self._proc: subprocess.Popen[bytes] | None = None
        self._ps: psutil.Process | None = None

    def __enter__(self) -> Self:
        try:
            self._start()
        except BaseException:
            self._stop()
            raise
        return self

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                 tb: TracebackType | None) -> None:
        self._stop()

    def _start(self) -> None:
        write_token(self.paths.token, self.token)
        recipe = self.run_dir / "recipe.yaml"
        recipe.write_text(self._recipe)
        argv = [sys.executable, "-m", "jetctl.cli.main", "server", "--recipe", str(recipe),
                "--model", self.model, "--run-dir", str(self.run_dir),
                "--port", str(free_port())]
        if not self._train:
            argv.append("--no-train")
        with self.log_path.open("w") as log:
            self._proc = subprocess.Popen(argv, stdout=log, stderr=subprocess.STDOUT,
                                          env={**os.environ, "JETCTL_TOKEN": self.token})
        self._ps = psutil.Process(self._proc.pid)
        endpoint_file = self.paths.server_file(self.model)
        deadline = time.monotonic() + START_TIMEOUT_S
        while not endpoint_file.exists():
            if self._proc.poll() is not None or time.monotonic() > deadline:
                raise BenchError("the bench server did not come up:\n" + self.log_tail())
            time.sleep(0.2)
        self.endpoint = json.loads(endpoint_file.read_text())["endpoint"]

    def _stop(self) -> None:
        if self._proc is not None and self._proc.poll() is None:
            self._proc.terminate()
            try:
                self._proc.wait(60)
            except subprocess.TimeoutExpired:
                self._proc.kill()
                self._proc.wait()
        self._tmp.cleanup()

    @property
    def log_path(self) -> Path:
        return self.run_dir / "server.log"

    def log_tail(self, chars: int = 4000) -> str:
        return self.log_path.read_text()[-chars:] if self.log_path.exists() else ""

    @property
    def pid(self) -> int:
        assert self._proc is not None
        return self._proc.pid

    def cpu_seconds(self) -> float:
        """User + system CPU the server process has used so far (all its threads)."""
        assert self._ps is not None
        t = self._ps.cpu_times()
        return float(t.user + t.system)

    def rss_bytes(self) -> int:
        assert self._ps is not None
        return int(self._ps.memory_info().rss)
