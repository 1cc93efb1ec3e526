"""Find and kill what a process started, also after that process is gone.

A client node runs in a session of its own (the process runtime starts it with
`start_new_session=True`) and each rollout is a process group of its own inside that
session (`os.setpgrp()`). Killing the node's group therefore misses its rollouts; killing
its *session* reaches them, and whatever they started, even once the node itself is dead.
Only processes that called `setsid` themselves escape.

Linux only (reads /proc); elsewhere the scans find nothing.
"""

from __future__ import annotations

import os
import signal
from pathlib import Path

import psutil


def _stat(pid: int) -> list[str] | None:
    """/proc/<pid>/stat after the command name (state first) of a live, non-zombie process."""
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except (OSError, IndexError):
        return None
    return None if fields[0] in ("Z", "X") else fields


def _ids(pid: int) -> tuple[int, int] | None:
    """(pgid, sid) of a live, non-zombie process; None if it is gone."""
    fields = _stat(pid)
    return None if fields is None else (int(fields[2]), int(fields[3]))


def start_time(pid: int) -> str:
    """The process's start time in clock ticks since boot ('' if it is gone): with the pid,
    it names one process even after the pid is reused."""
    fields = _stat(pid)
    return "" if fields is None else fields[19]


def members(*, sid: int | None = None, pgid: int | None = None) -> list[int]:
    """Pids of the live processes in session `sid` and/or process group `pgid`."""
    found = []
    for entry in os.scandir("/proc") if os.path.isdir("/proc") else ():
        if not entry.name.isdigit():
            continue
        ids = _ids(int(entry.name))
        if ids is None:
            continue
        if (pgid is None or ids[0] == pgid) and (sid is None or ids[1] == sid):
            found.append(int(entry.name))
    return found


def kill_session(sid: int, sig: signal.Signals = signal.SIGKILL) -> int:
    """Signal every process of session `sid` (except this one); returns how many."""
    n = 0
    for pid in members(sid=sid):
        if pid == os.getpid():
            continue
        try:
            os.kill(pid, sig)
            n += 1
        except (ProcessLookupError, PermissionError):
            pass
    return n


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
    """psutil's create time of `pid` (0.0 if it is gone): what pid files record."""
    try:
        return float(psutil.Process(pid).create_time())
    except psutil.Error:
        return 0.0
