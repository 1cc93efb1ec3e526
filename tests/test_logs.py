"""Structured logs (jetctl.logs): what each process writes, and how `jetctl logs` merges,
filters and follows the files."""

from __future__ import annotations

import json
import logging
import re
from pathlib import Path

import pytest

from jetctl.logs import LogFilter, LogLine, follow, install_json_log, parse_since, read_lines
from jetctl.rundir import RunPaths

pytestmark = pytest.mark.unit


def _write(path: Path, *lines: dict[str, object]) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    with path.open("a") as f:
        f.writelines(json.dumps(line) + "\n" for line in lines)


def _line(t: float, process: str, message: str, **fields: str) -> dict[str, object]:
    return {"time": t, "level": "INFO", "logger": "jetctl.x", "process": process,
            "message": message, **fields}


@pytest.fixture
def logs_dir(tmp_path: Path) -> Path:
    d = tmp_path / "logs"
    _write(d / "controller.jsonl", _line(1.0, "controller", "run started"),
           _line(5.0, "controller", "node digits-1 exited"))
    _write(d / "server-policy.jsonl", _line(2.0, "server-policy", "group g1 refused: stale",
                                            model="policy"),
           _line(4.0, "server-policy", "step 1", model="policy"))
    _write(d / "digits-0.jsonl", _line(3.0, "digits-0", "rollout failed", task="digits"))
    _write(d / "code-0.jsonl", _line(3.5, "code-0", "rollout ok", task="code"))
    (d / "controller.log").write_text("human lines are not read\n")
    with (d / "digits-0.jsonl").open("a") as f:
        f.write('{"time": 9.0, "proc')  # a torn last line, still being written
    return d


def test_lines_of_every_process_are_merged_in_time_order(logs_dir: Path) -> None:
    lines = read_lines(logs_dir, LogFilter())
    assert [(line.time, line.process) for line in lines] == [
        (1.0, "controller"), (2.0, "server-policy"), (3.0, "digits-0"), (3.5, "code-0"),
        (4.0, "server-policy"), (5.0, "controller")]


@pytest.mark.parametrize(("keep", "messages"), [
    (LogFilter(node="digits-0"), ["rollout failed"]),
    (LogFilter(task="code"), ["rollout ok"]),
    (LogFilter(server="policy"), ["group g1 refused: stale", "step 1"]),
    (LogFilter(since=3.2), ["rollout ok", "step 1", "node digits-1 exited"]),
    (LogFilter(grep=re.compile("stale|exited")), ["group g1 refused: stale",
                                                 "node digits-1 exited"]),
    (LogFilter(server="policy", grep=re.compile("step")), ["step 1"]),
])
def test_filters(logs_dir: Path, keep: LogFilter, messages: list[str]) -> None:
    assert [line.message for line in read_lines(logs_dir, keep)] == messages


def test_since_reads_durations() -> None:
    assert parse_since("10m", now=1000.0) == 400.0
    assert parse_since("2h", now=10_000.0) == 2800.0
    with pytest.raises(ValueError, match="e.g. 90s"):
        parse_since("ten minutes", now=0.0)


def test_follow_sees_lines_written_later_also_by_a_new_process(logs_dir: Path) -> None:
    seen: list[str] = []
    it = follow(logs_dir, LogFilter(), poll_s=0.05)
    for _ in range(6):
        seen.append(next(it).message)
    assert seen[-1] == "node digits-1 exited"
    _write(logs_dir / "digits-1.jsonl", _line(6.0, "digits-1", "joined late", task="digits"))
    with (logs_dir / "digits-0.jsonl").open("a") as f:
        f.write('ess": "digits-0", "message": "the torn line, finished"}\n')
    later = [next(it), next(it)]
    assert sorted(line.message for line in later) == ["joined late", "the torn line, finished"]


def test_a_process_writes_json_lines_with_its_fields_and_traceback(tmp_path: Path) -> None:
    paths = RunPaths(tmp_path)
    log = logging.getLogger("jetctl.test_logs")
    log.setLevel(logging.INFO)
    path = install_json_log(paths, "digits-0", task="digits")
    handler = logging.getLogger().handlers[-1]
    try:
        log.info("rollout %d done", 7)
        log.debug("not at INFO")
        try:
            raise OSError("env down")
        except OSError:
            log.exception("rollout failed")
    finally:
        logging.getLogger().removeHandler(handler)
        handler.close()
    assert path == tmp_path / "logs" / "digits-0.jsonl"
    lines = [LogLine.parse(t) for t in path.read_text().splitlines()]
    assert [(x.process, x.message, x.fields["task"]) for x in lines if x] == [
        ("digits-0", "rollout 7 done", "digits"), ("digits-0", "rollout failed", "digits")]
    assert lines[1] is not None and "OSError: env down" in lines[1].fields["exc"]
    assert "OSError: env down" in lines[1].render()
