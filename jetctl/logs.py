"""Structured logs: every process writes JSON lines beside its human log, and `jetctl logs`
merges them in time order.

    install_json_log(RunPaths(run_dir), "server-policy", model="policy")   # at process start
    lines = read_lines(RunPaths(run_dir).logs, LogFilter(task="digits", grep="refused"))
    for line in follow(RunPaths(run_dir).logs, LogFilter()): print(line.render())

Each process (the controller, each server `server-<model>`, each client node `<task>-<i>`)
appends to `logs/<process>.jsonl` one object per record: `time` (epoch seconds), `level`,
`logger`, `process`, `message`, and the process's own fields (`model` for a server, `task`
for a client node), plus `exc` with the traceback when there is one. The human format stays
on the terminal and in `logs/<process>.log`.

Left out: nodes on other hosts. Their lines stay in the run dir of the host they run on
(`--run-dir` of `jetctl client`); the controller does not collect them yet, so `jetctl logs`
on the controller's host shows only this host's processes.
"""

from __future__ import annotations

import json
import logging
import re
import time
import traceback
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from jetctl.rundir import RunPaths

SUFFIX = ".jsonl"


class JsonLineFormatter(logging.Formatter):
    """One JSON object per record, with the process's name and fields."""

    def __init__(self, process: str, fields: dict[str, str]) -> None:
        super().__init__()
        self.process = process
        self.fields = fields

    def format(self, record: logging.LogRecord) -> str:
        line: dict[str, Any] = {
            "time": record.created, "level": record.levelname, "logger": record.name,
            "process": self.process, **self.fields, "message": record.getMessage(),
        }
        if record.exc_info:
            line["exc"] = "".join(traceback.format_exception(*record.exc_info))
        return json.dumps(line)


def install_json_log(paths: RunPaths, process: str, **fields: str) -> Path:
    """Append the root logger's records (INFO and up) to `logs/<process>.jsonl`."""
    path = paths.json_log(process)
    path.parent.mkdir(parents=True, exist_ok=True)
    handler = logging.FileHandler(path)
    handler.setLevel(logging.INFO)
    handler.setFormatter(JsonLineFormatter(process, fields))
    # on the root logger: records of every logger that lets INFO through propagate to it
    logging.getLogger().addHandler(handler)
    return path


@dataclass(frozen=True)
class LogLine:
    time: float
    process: str
    level: str
    logger: str
    message: str
    fields: dict[str, Any] = field(default_factory=dict)  # model, task, exc, ...

    @classmethod
    def parse(cls, text: str) -> LogLine | None:
        """None for a line that is not one of ours (a torn last line while it is written)."""
        try:
            d = json.loads(text)
        except ValueError:
            return None
        if not isinstance(d, dict) or not {"time", "process", "message"} <= d.keys():
            return None
        known = ("time", "process", "level", "logger", "message")
        return cls(float(d["time"]), str(d["process"]), str(d.get("level", "")),
                   str(d.get("logger", "")), str(d["message"]),
                   {k: v for k, v in d.items() if k not in known})

    def render(self) -> str:
        stamp = time.strftime("%H:%M:%S", time.localtime(self.time))
        ms = int((self.time % 1) * 1000)
        text = f"{stamp}.{ms:03d} {self.process:<14} {self.level:<7} {self.logger}: {self.message}"
        exc = self.fields.get("exc")
        return f"{text}\n{exc.rstrip()}" if exc else text


@dataclass(frozen=True)
class LogFilter:
    """Which lines `jetctl logs` shows: each set option must match."""

    node: str | None = None  # a process name: digits-0, server-policy, controller
    task: str | None = None  # a client node's task
    server: str | None = None  # a model: its server's lines
    since: float | None = None  # epoch seconds
    grep: re.Pattern[str] | None = None  # searched in the message (and traceback)

    def __call__(self, line: LogLine) -> bool:
        if self.node is not None and line.process != self.node:
            return False
        if self.task is not None and line.fields.get("task") != self.task:
            return False
        if self.server is not None and line.process != f"server-{self.server}":
            return False
        if self.since is not None and line.time < self.since:
            return False
        text = line.message + str(line.fields.get("exc", ""))
        return self.grep is None or self.grep.search(text) is not None


def parse_since(text: str, now: float) -> float:
    """`10m`, `90s`, `2h`, `1d` before `now` -> epoch seconds. Raises ValueError."""
    m = re.fullmatch(r"(\d+(?:\.\d+)?)([smhd])", text.strip())
    if m is None:
        raise ValueError(f"--since {text!r}: give a number and a unit, e.g. 90s, 10m, 2h, 1d")
    return now - float(m[1]) * {"s": 1, "m": 60, "h": 3600, "d": 86400}[m[2]]


def read_lines(logs_dir: Path, keep: LogFilter) -> list[LogLine]:
    """Every kept line of every process's file, in time order (a stable merge: lines of one
    process with the same time keep their order)."""
    lines = [line for path in sorted(logs_dir.glob(f"*{SUFFIX}"))
             for line in _parse_all(path.read_text(errors="replace").splitlines())]
    return sorted(filter(keep, lines), key=lambda line: line.time)


def follow(logs_dir: Path, keep: LogFilter, poll_s: float = 0.5) -> Iterator[LogLine]:
    """What `read_lines` gives, then each new kept line as it is written (also from a
    process that starts later), until the caller stops. Lines that arrive in one poll are
    put in time order."""
    offsets: dict[Path, int] = {}
    partial: dict[Path, str] = {}
    while True:
        fresh: list[LogLine] = []
        for path in sorted(logs_dir.glob(f"*{SUFFIX}")):
            with path.open("rb") as f:
                f.seek(offsets.get(path, 0))
                data = f.read()
                offsets[path] = f.tell()
            text = partial.pop(path, "") + data.decode(errors="replace")
            complete, _, rest = text.rpartition("\n")
            if rest:
                partial[path] = rest  # a line still being written
            fresh += _parse_all(complete.splitlines())
        yield from sorted(filter(keep, fresh), key=lambda line: line.time)
        time.sleep(poll_s)


def _parse_all(texts: list[str]) -> list[LogLine]:
    return [line for t in texts if (line := LogLine.parse(t)) is not None]
