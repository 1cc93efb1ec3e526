"""Chaos: train while faults happen, heal, quiesce, and balance the ledger.

    run = ChaosRun(Path("recipes/tiny.yaml"), Path("runs/chaos"))
    run.start()                              # a controller in this process, a proxy per model
    run.wait_version("policy", 2)
    run.kill_server("policy", during="checkpoint")   # kill -9; measures restart to serving
    run.kill_client("digits-0")              # kill -9 mid-rollout
    run.partition(20.0)                      # blackhole every client <-> server link
    run.drop_acks(0.3, 20.0)                 # servers commit, then drop 30% of Submit replies
    run.quiesce()                            # heal, drain clients (flush spools), then servers
    print(run.ledger().render())
    run.close()

`jetctl chaos RECIPE --duration S` runs `run_schedule`: these faults round-robin for S
seconds, then the quiesce and the ledger (docs/architecture.md section 6: nothing acked is
lost, nothing is trained twice). Every fault returns a `FaultRecord` with what was measured:
restart-to-serving of a killed server (and the version it resumed from, which must be its
last complete checkpoint), restart of a killed client (and how many rollouts it lost),
recovery after a partition (heal until every group spooled during it is acked; it must not
take longer than the outage).

How the faults are made: `kill -9` of the pid in `servers/<model>.json` or
`nodes/<node>.json`; the controller restarts them. Clients reach the servers through a
`jetctl.netproxy` proxy (`JETCTL_ENDPOINT_OVERRIDE`), which blackholes the link. Lost acks
and a slow checkpoint (a window for a kill mid-checkpoint) are `jetctl.faults` switched
through the faults file (`JETCTL_FAULTS_FILE`). Both variables are set in this process's
environment while the run lives, so the nodes the controller starts inherit them.

Left out: corrupt / oversized / unauthenticated payloads (tests/security fuzzes those) and
killing the controller itself.
"""

from __future__ import annotations

import logging
import os
import signal
import sqlite3
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import closing
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from jetctl.faults import ENDPOINT_OVERRIDE_ENV, FAULTS_FILE_ENV, write_faults_file
from jetctl.netproxy import Mode, ProxyThread
from jetctl.recipe import Recipe
from jetctl.run.ledger import Ledger, build_ledger
from jetctl.rundir import RunPaths, peek_run_record, read_json, read_run_record

log = logging.getLogger("jetctl.run.chaos")

SERVER_RESTART_BUDGET_S = 30.0  # builtin:tiny, kill -9 to serving again


class ChaosError(RuntimeError):
    """The run did not get where a fault needs it (no server, no checkpoint in time, ...)."""


@dataclass
class FaultRecord:
    """One injected fault and what was measured around it."""

    kind: str
    target: str
    at_s: float  # since the run started
    outage_s: float = 0.0
    recovery_s: float | None = None  # None: did not recover in time
    budget_s: float | None = None  # recovery must not take longer than this
    detail: str = ""
    figures: dict[str, Any] = field(default_factory=dict)

    @property
    def ok(self) -> bool:
        if self.recovery_s is None:
            return False
        return self.budget_s is None or self.recovery_s <= self.budget_s

    def line(self) -> str:
        rec = "-" if self.recovery_s is None else f"{self.recovery_s:.1f}s"
        budget = "" if self.budget_s is None else f" (<= {self.budget_s:.0f}s)"
        outage = f" outage {self.outage_s:.0f}s," if self.outage_s else ""
        mark = "ok " if self.ok else "BAD"
        return (f"{mark} t={self.at_s:6.1f}s {self.kind:<28} {self.target:<10}{outage} "
                f"recovered in {rec}{budget}; {self.detail}")


def _query(path: Path, sql: str) -> list[tuple[Any, ...]]:
    """Rows from a live sqlite file, read-only ([] when it is not there yet)."""
    if not path.is_file():
        return []
    try:
        with closing(sqlite3.connect(f"file:{path}?mode=ro", uri=True, timeout=10)) as db:
            return db.execute(sql).fetchall()
    except sqlite3.Error:
        return []


def checkpoint_versions(root: Path) -> list[int]:
    """Versions of the complete checkpoints under root (manifest written last)."""
    out = []
    for p in root.glob("step-*"):
        if p.is_dir() and not p.name.endswith(".partial") and (p / "manifest.json").is_file():
            out.append(int(p.name.removeprefix("step-")))
    return sorted(out)


class ChaosRun:
    """A training run under a controller in this process, with fault injectors."""

    def __init__(
        self, recipe_path: Path, run_dir: Path, *, grace_s: float = 30.0,
        say: Callable[[str], None] | None = None,
    ) -> None:
        from jetctl.recipe import load_recipe

        self.recipe_path = Path(recipe_path)
        self.recipe: Recipe = load_recipe(self.recipe_path)
        self.run_dir = Path(run_dir).resolve()
        self.paths = RunPaths(self.run_dir)
        self.grace_s = grace_s
        self.say = say or (lambda msg: log.info("%s", msg))
        self.records: list[FaultRecord] = []
        self.proxies: dict[str, ProxyThread] = {}
        self.faults_file = self.paths.faults
        self._env_before: dict[str, str | None] = {}
        self._ctl: Any = None
        self._thread: threading.Thread | None = None
        self._t0 = time.monotonic()

    # -- lifecycle ----------------------------------------------------------------------

    def start(self) -> None:
        from jetctl.controller.controller import Controller, ControllerOptions

        self.run_dir.mkdir(parents=True, exist_ok=True)
        write_faults_file(self.faults_file, {})
        ctl = Controller(
            self.recipe, self.recipe_path, run_dir=self.run_dir,
            options=ControllerOptions(grace_s=self.grace_s),
        )
        ctl.setup()  # picks the servers' ports and writes run.json; starts nothing yet
        self._ctl = ctl
        routes = []
        for model, endpoint in read_run_record(self.paths.root).server_endpoints.items():
            host, _, port = endpoint.rpartition(":")
            self.proxies[model] = ProxyThread((host, int(port)))
            routes.append(f"{model}={self.proxies[model].endpoint}")
        self._setenv(FAULTS_FILE_ENV, str(self.faults_file))
        self._setenv(ENDPOINT_OVERRIDE_ENV, ",".join(routes))
        self._t0 = time.monotonic()
        self._thread = threading.Thread(target=ctl.serve_forever, name="chaos-controller")
        self._thread.start()
        self.say(f"run {self.recipe.run.name} in {self.run_dir}; clients reach servers through "
                 + ", ".join(f"{m} -> {p.endpoint}" for m, p in self.proxies.items()))

    def quiesce(self) -> None:
        """Heal every fault, then drain: clients finish and flush, servers checkpoint."""
        for proxy in self.proxies.values():
            proxy.set_mode("pass")
        write_faults_file(self.faults_file, {})
        if self._ctl is None or self._thread is None:
            return
        self.say("quiescing: healing, draining clients (flush spools), then servers")
        self._ctl.request_stop("chaos: quiesce", grace_s=self.grace_s)
        self._thread.join(timeout=2 * self.grace_s + 60)
        if self._thread.is_alive():
            raise ChaosError("the controller did not finish draining; see logs/controller.log")

    def close(self) -> None:
        if self._thread is not None and self._thread.is_alive():
            self._ctl.request_stop("chaos: close", grace_s=0)
            self._thread.join(timeout=30)
        for proxy in self.proxies.values():
            proxy.close()
        for key, value in self._env_before.items():
            if value is None:
                os.environ.pop(key, None)
            else:
                os.environ[key] = value
        self._env_before.clear()

    def ledger(self) -> Ledger:
        return build_ledger(self.run_dir)

    def _setenv(self, key: str, value: str) -> None:
        self._env_before.setdefault(key, os.environ.get(key))
        os.environ[key] = value

    # -- reading the run ----------------------------------------------------------------

    def elapsed(self) -> float:
        return time.monotonic() - self._t0

    def server_info(self, model: str) -> dict[str, Any] | None:
        return read_json(self.paths.server_file(model))

    def node_info(self, name: str) -> dict[str, Any] | None:
        return read_json(self.paths.node_file(name))

    def client_names(self) -> list[str]:
        info = peek_run_record(self.paths.root)
        return sorted(info.clients) if info is not None else []

    def version(self, model: str) -> int:
        info = self.server_info(model)
        return int(info.get("version", 0)) if info else 0

    def resumed_from(self, model: str) -> list[int]:
        """The checkpoint version of each start of the server (from its store)."""
        rows = _query(self.paths.store(model),
                      "SELECT resumed_from FROM epochs ORDER BY epoch")
        return [int(r[0]) for r in rows]

    def checkpoint_dir(self, model: str) -> Path:
        d = self.recipe.models[model].checkpoint.dir
        return Path(d) if d else self.paths.checkpoints(model)

    def spool_pending(self) -> set[str]:
        """Group ids pending in any client spool."""
        out: set[str] = set()
        for path in self.paths.spools().values():
            out |= {r[0] for r in _query(path, "SELECT id FROM pending")}
        return out

    def wait(self, what: str, cond: Callable[[], bool], timeout_s: float, poll_s: float = 0.2) -> float:
        """Seconds until cond() held; ChaosError after timeout_s."""
        t0 = time.monotonic()
        while not cond():
            if self._thread is not None and not self._thread.is_alive():
                raise ChaosError(f"the controller stopped while waiting for {what}")
            if time.monotonic() - t0 > timeout_s:
                raise ChaosError(f"timed out after {timeout_s:.0f}s waiting for {what}")
            time.sleep(poll_s)
        return time.monotonic() - t0

    def wait_version(self, model: str, version: int, timeout_s: float = 180.0) -> float:
        return self.wait(f"{model} version {version}",
                         lambda: self.version(model) >= version, timeout_s)

    def _set_faults(self, **faults: float) -> None:
        write_faults_file(self.faults_file, faults)

    # -- faults -------------------------------------------------------------------------

    def kill_server(self, model: str, during: str = "batch", timeout_s: float = 180.0) -> FaultRecord:
        """kill -9 the server mid-batch (while it trains) or mid-checkpoint (a checkpoint is
        held open by stall_checkpoint); measure kill to serving again, and check it resumed
        from its last complete checkpoint."""
        ckpt_dir = self.checkpoint_dir(model)
        self.wait(f"{model} serving", lambda: self.server_info(model) is not None, timeout_s)
        if during == "checkpoint":
            self._set_faults(stall_checkpoint=5.0)
            self.wait(f"a checkpoint of {model} in progress",
                      lambda: any(ckpt_dir.glob("step-*.partial")), timeout_s, poll_s=0.05)
        else:
            start = self.version(model)
            self.wait(f"{model} training", lambda: self.version(model) > start, timeout_s)
        info = self.server_info(model) or {}
        pid, version_before = int(info["pid"]), int(info.get("version", 0))
        partial = sorted(p.name for p in ckpt_dir.glob("step-*.partial"))
        at = self.elapsed()
        t_kill = time.monotonic()
        os.kill(pid, signal.SIGKILL)
        self._set_faults()
        complete = checkpoint_versions(ckpt_dir)
        expect = complete[-1] if complete else 0
        starts = len(self.resumed_from(model))
        rec = FaultRecord(f"server kill -9 mid-{during}", model, at, budget_s=SERVER_RESTART_BUDGET_S)
        try:
            self.wait(f"{model} serving again", lambda: (self.server_info(model) or {}).get(
                "pid", pid) != pid, timeout_s, poll_s=0.1)
            rec.recovery_s = time.monotonic() - t_kill
        except ChaosError as e:
            rec.detail = str(e)
            self.records.append(rec)
            return rec
        resumed = self.resumed_from(model)
        got = resumed[-1] if len(resumed) > starts else None
        rec.figures = {"pid": pid, "version_at_kill": version_before, "checkpoint": expect,
                       "resumed_from": got, "partial": partial}
        rec.detail = (f"version {version_before} at the kill; resumed from {got} "
                      f"(last complete checkpoint {expect})"
                      + (f"; {partial[0]} left incomplete" if partial else ""))
        if got != expect:
            rec.detail += " RESUMED FROM THE WRONG CHECKPOINT"
            rec.recovery_s = None
        self.records.append(rec)
        self.say(rec.line())
        return rec

    def kill_client(self, name: str, timeout_s: float = 120.0) -> FaultRecord:
        """kill -9 a client node while its rollouts run; measure until it runs again."""
        spool = self.paths.spool(name)

        def rolling() -> bool:
            info = self.node_info(name) or {}
            return info.get("state") == "running" and bool(
                _query(spool, "SELECT 1 FROM inflight LIMIT 1"))

        try:
            self.wait(f"{name} mid-rollout", rolling, timeout_s, poll_s=0.05)
        except ChaosError:
            pass  # kill it anyway: between rollouts is a crash too
        info = self.node_info(name) or {}
        pid = int(info["pid"])
        inflight = len(_query(spool, "SELECT 1 FROM inflight"))
        lost_before = len(_query(spool, "SELECT 1 FROM dropped WHERE reason='lost'"))
        at = self.elapsed()
        t_kill = time.monotonic()
        os.kill(pid, signal.SIGKILL)
        rec = FaultRecord("client kill -9 mid-rollout", name, at)
        try:
            self.wait(f"{name} running again", lambda: (self.node_info(name) or {}).get("pid") != pid
                      and (self.node_info(name) or {}).get("state") == "running", timeout_s)
            rec.recovery_s = time.monotonic() - t_kill
        except ChaosError as e:
            rec.detail = str(e)
        lost = len(_query(spool, "SELECT 1 FROM dropped WHERE reason='lost'")) - lost_before
        rec.figures = {"rollouts_in_flight": inflight, "recorded_lost": lost}
        rec.detail = (rec.detail or "") + (
            f"{inflight} rollouts in flight at the kill, {lost} recorded dropped(lost)")
        self.records.append(rec)
        self.say(rec.line())
        return rec

    def partition(self, seconds: float, mode: Mode = "blackhole", drain_timeout_s: float | None = None) -> FaultRecord:
        """Cut every client <-> server link for `seconds`, heal, and measure until every
        group pending at the heal is acked (recovery; its budget is the outage)."""
        at = self.elapsed()
        for proxy in self.proxies.values():
            proxy.set_mode(mode)
        self.say(f"t={at:.1f}s partition: {mode} for {seconds:.0f}s")
        peak_bytes, unreachable, backpressure = 0, set(), set()
        end = time.monotonic() + seconds
        while time.monotonic() < end:
            for name in self.client_names():
                info = self.node_info(name) or {}
                peak_bytes = max(peak_bytes, int(info.get("spool_bytes") or 0))
                if info.get("server_reachable") is False:
                    unreachable.add(name)
                if info.get("backpressure"):
                    backpressure.add(name)
            time.sleep(min(0.5, max(0.0, end - time.monotonic())))
        pending = self.spool_pending()
        for proxy in self.proxies.values():
            proxy.set_mode("pass")
        t_heal = time.monotonic()
        rec = FaultRecord(f"partition ({mode})", "all", at, outage_s=seconds, budget_s=seconds)
        try:
            self.wait("the spools to drain after the heal",
                      lambda: not (pending & self.spool_pending()),
                      drain_timeout_s or max(3 * seconds, 60.0), poll_s=0.1)
            rec.recovery_s = time.monotonic() - t_heal
        except ChaosError as e:
            rec.detail = f"{e}; "
        rec.figures = {"pending_at_heal": len(pending), "peak_spool_bytes": peak_bytes,
                       "unreachable_seen": sorted(unreachable),
                       "backpressure_seen": sorted(backpressure)}
        rec.detail += (f"{len(pending)} groups pending at the heal, spool peak {peak_bytes} B, "
                       f"unreachable seen by {len(unreachable)}, back-pressure on {len(backpressure)}")
        self.records.append(rec)
        self.say(rec.line())
        return rec

    def drop_acks(self, rate: float, seconds: float, until_dropped: int | None = None) -> FaultRecord:
        """Servers commit each Submit, then drop its reply with probability `rate`, for
        `seconds`, or only until `until_dropped` replies were dropped when that is given."""
        before = self._dropped_acks()
        at = self.elapsed()
        t0 = time.monotonic()
        self._set_faults(drop_ack=rate)
        end = t0 + seconds
        if until_dropped is None:
            time.sleep(seconds)
        else:
            while (time.monotonic() < end
                   and self._dropped_acks() - before < until_dropped):
                time.sleep(min(0.2, max(0.0, end - time.monotonic())))
        self._set_faults()
        window = seconds if until_dropped is None else time.monotonic() - t0
        dropped = self._dropped_acks() - before
        rec = FaultRecord(f"drop acks p={rate:g}", "servers", at, outage_s=0.0, recovery_s=0.0,
                          detail=f"{dropped} replies dropped after commit in {window:.0f}s",
                          figures={"dropped_acks": dropped})
        self.records.append(rec)
        self.say(rec.line())
        return rec

    def _dropped_acks(self) -> int:
        n = 0
        for path in self.paths.logs.glob("server-*.log"):
            try:
                n += path.read_text(errors="replace").count("fault drop_ack:")
            except OSError:
                pass
        return n


def schedule(run: ChaosRun, duration_s: float) -> Iterator[Callable[[], FaultRecord]]:
    """The faults of `jetctl chaos`, round-robin (partitions scale with the duration)."""
    model = next(iter(run.recipe.models))
    clients = run.client_names() or [""]
    partition_s = min(20.0, max(5.0, duration_s / 20))
    cycle: list[Callable[[], FaultRecord]] = [
        lambda: run.kill_server(model, "batch"),
        lambda: run.kill_client(clients[0]),
        lambda: run.partition(partition_s),
        lambda: run.drop_acks(0.3, 20.0),
        lambda: run.kill_server(model, "checkpoint"),
        lambda: run.kill_client(clients[-1]),
        lambda: run.partition(partition_s, mode="reset"),
    ]
    i = 0
    while True:
        yield cycle[i % len(cycle)]
        i += 1


def run_schedule(run: ChaosRun, duration_s: float, gap_s: float = 10.0,
                 fault_budget_s: float = 60.0,
                 max_faults: int | None = None) -> tuple[list[FaultRecord], Ledger]:
    """Warm up, inject faults until `duration_s` is nearly spent, quiesce, balance.
    With `max_faults`, the quiesce comes as soon as that many faults were injected."""
    model = next(iter(run.recipe.models))
    end = time.monotonic() + duration_s
    run.start()
    try:
        run.wait_version(model, 1, timeout_s=max(120.0, duration_s / 2))
        for injected, fault in enumerate(schedule(run, duration_s), start=1):
            if time.monotonic() + fault_budget_s > end:
                break
            try:
                fault()
            except ChaosError as e:
                run.say(f"fault not injected: {e}")
                run.records.append(FaultRecord("error", "-", run.elapsed(), detail=str(e)))
            if max_faults is not None and injected >= max_faults:
                end = time.monotonic()
                break
            time.sleep(max(0.0, min(gap_s, end - time.monotonic())))
        time.sleep(max(0.0, end - time.monotonic()))
        run.quiesce()
    finally:
        run.close()
    return run.records, run.ledger()
