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

Nodes whose logs are not in the controller's run dir (a node that joined from another host,
a Ray actor's node, a server the user runs: the Join reply's `ship_logs`) also ship their JSON
lines to the controller with each Sync (`LogShipper`: INFO and up, at most SHIP_BYTES a
sync, the oldest dropped and counted past SHIP_BACKLOG lines); the controller appends them
to its own `logs/<node>.jsonl` (`LogSink`), so `jetctl logs` on the controller's host merges
every node's lines. The controller trusts none of it: a line must be a JSON object of
bounded size, its `process` is set to the node's authenticated name (no node writes another
process's log), and a node's file stops growing past SINK_MAX_BYTES (counted, said once).
"""

from __future__ import annotations

import json
import logging
import re
import threading
import time
import traceback
from collections import deque
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


SHIP_BYTES = 256 * 1024  # log bytes one Sync carries at most
SHIP_BACKLOG = 20_000  # lines a node holds while the controller is away; then the oldest go
LINE_MAX_BYTES = 16 * 1024  # a shipped line longer than this is refused by the controller
SINK_MAX_BYTES = 256 * 1024 * 1024  # a node's shipped log stops growing at this size


class LogShipper(logging.Handler):
    """Holds the process's JSON log lines until a Sync takes them (`take`); a failed Sync
    gives them back (`put_back`)."""

    def __init__(self, process: str, fields: dict[str, str]) -> None:
        super().__init__(level=logging.INFO)
        self.setFormatter(JsonLineFormatter(process, fields))
        self._lines: deque[str] = deque()
        self._lock = threading.Lock()
        self.dropped = 0

    def emit(self, record: logging.LogRecord) -> None:
        try:
            line = self.format(record)
        except Exception:  # noqa: BLE001 - logging must not raise
            self.handleError(record)
            return
        with self._lock:
            self._lines.append(line)
            while len(self._lines) > SHIP_BACKLOG:
                self._lines.popleft()
                self.dropped += 1

    def take(self, max_bytes: int = SHIP_BYTES) -> list[str]:
        out: list[str] = []
        size = 0
        with self._lock:
            while self._lines and (not out or size + len(self._lines[0]) <= max_bytes):
                line = self._lines.popleft()
                out.append(line)
                size += len(line)
        return out

    def put_back(self, lines: list[str]) -> None:
        with self._lock:
            self._lines.extendleft(reversed(lines))
            while len(self._lines) > SHIP_BACKLOG:
                self._lines.pop()  # the newest go: the oldest are what the controller lacks
                self.dropped += 1


def install_log_shipper(process: str, **fields: str) -> LogShipper:
    """A `LogShipper` on the root logger (records of every logger propagate to it)."""
    shipper = LogShipper(process, fields)
    logging.getLogger().addHandler(shipper)
    return shipper


class LogSink:
    """The controller's side: appends the lines each node shipped to `logs/<node>.jsonl`."""

    def __init__(self, paths: RunPaths) -> None:
        self.paths = paths
        self._lock = threading.Lock()
        self.refused = 0  # lines that were not a bounded JSON object
        self.over = 0  # lines past a node's SINK_MAX_BYTES
        self._full: set[str] = set()

    def write(self, node: str, lines: list[str]) -> None:
        kept: list[str] = []
        for text in lines:
            d = _json_object(text)
            if d is None:
                self.refused += 1
                continue
            d["process"] = node  # the authenticated name, whatever the line said
            kept.append(json.dumps(d))
        if not kept:
            return
        path = self.paths.json_log(node)
        with self._lock:
            path.parent.mkdir(parents=True, exist_ok=True)
            size = path.stat().st_size if path.exists() else 0
            room = SINK_MAX_BYTES - size
            fits = []
            for line in kept:
                if len(line) + 1 > room:
                    self.over += 1
                    continue
                fits.append(line)
                room -= len(line) + 1
            if len(fits) < len(kept) and node not in self._full:
                self._full.add(node)
                logging.getLogger("jetctl.controller").warning(
                    "%s's shipped log reached %d bytes: later lines are dropped", node,
                    SINK_MAX_BYTES)
            if fits:
                with path.open("a", encoding="utf-8") as f:
                    f.write("".join(line + "\n" for line in fits))


def _json_object(text: str) -> dict[str, Any] | None:
    if len(text) > LINE_MAX_BYTES:
        return None
    try:
        d = json.loads(text)
    except ValueError:
        return None
    if not isinstance(d, dict) or not isinstance(d.get("time"), (int, float)) \
            or not isinstance(d.get("message"), str):
        return None
    return d


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
