"""A run across four hosts that share no run directory, and a partition of one of them.

Hosts are network namespaces on the test's own veth links (tests/multihost/netns.py): the
controller on `ctl`, a server the user starts on `srv` (`models.policy.runtime: external`,
`jetctl server --join`), one client node joined by hand on each of `c1` and `c2` (`jetctl
client --join`). Each has its own folder; the only files carried between them are the run
CA's certificates, as a user would copy them (the run uses TLS, with the hosts' addresses as
names). Then `c1` loses its link until the controller shows its node unreachable (15 s
without a sync): its node keeps rolling out (`inference: local`: it generates with the
weights it pulled last) and spools, training goes on with `c2`, and after the heal the
spooled groups are delivered (`max_staleness` is large: they are accepted, not refused as
stale). After `jetctl down` the ledger, built from what the controller received, balances,
and equals the ledger of the hosts' own files.
"""

from __future__ import annotations

import json
import os
import shutil
import sqlite3
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import pytest

from jetctl.run.ledger import build_ledger, ledger_from_files
from jetctl.run.status import finished_summary
from jetctl.rundir import RunPaths
from tests.multihost.netns import Hosts, need_netns

pytestmark = [pytest.mark.integration, pytest.mark.multihost]

ROOT = Path(__file__).resolve().parents[2]
JETCTL = [sys.executable, "-m", "jetctl.cli.main"]
TOKEN = "multihost-test-token-0123456789"
PORT = 7700
CUT_S = 30.0  # the most each effect of the cut (and the recovery after it) may take

RECIPE = """
run:
  name: hosts
  token: {token}
  control: {{host: 0.0.0.0, port: {port}, advertise: {ctl}}}
  tls: {{mode: tls}}
models:
  policy:
    model: builtin:tiny
    finetune: full
    optimizer: {{lr: 2.0e-3}}
    train: {{groups_per_step: 2, max_staleness: 1000}}
    runtime: external
    host: 0.0.0.0
    advertise: {srv}
tasks:
  digits:
    env: envs.digits:make_env
    agent: agents.noisy:agent  # reward variance from the first group: steps at once
    model: policy
    clients: 0
    group_size: 4
    concurrency: 4
    inference: local
    sampling: {{max_tokens: 4}}
"""


def wait_for(cond: Callable[[], Any], timeout_s: float, what: str) -> Any:
    deadline = time.monotonic() + timeout_s
    value = None
    while time.monotonic() < deadline:
        value = cond()
        if value:
            return value
        time.sleep(0.5)
    raise AssertionError(f"timed out after {timeout_s:.0f}s waiting for {what} (last: {value!r})")


@pytest.fixture
def hosts() -> Iterator[Hosts]:
    need_netns()
    with Hosts(["ctl", "srv", "c1", "c2"]) as h:
        yield h


def env() -> dict[str, str]:
    return {**os.environ, "PYTHONPATH": str(ROOT), "JETCTL_TOKEN": ""}


def status(hosts: Hosts, run_dir: Path, host: str = "ctl") -> dict[str, Any]:
    """`jetctl status --json` asked from `host` (the controller's); {} while it cannot answer."""
    res = hosts.run(host, [*JETCTL, "status", "--run-dir", str(run_dir), "--once", "--json"],
                    env=env(), cwd=ROOT, timeout=30)
    return json.loads(res.stdout) if res.returncode == 0 else {}


class StatusWatch:
    """`jetctl status --json --interval 0.5` left running on `host`: one JSON document a line,
    read from its log. One interpreter for the whole wait instead of one per question (each
    costs a second of CPU, taken from the run on a 2-core machine). Calling it gives the
    newest document of the current watcher, {} while there is none; a watcher that exited
    (the controller not up yet, or gone) is started again. `restart()` forgets every document
    computed before it (after a controller was replaced)."""

    def __init__(self, hosts: Hosts, run_dir: Path, log: Path, host: str = "ctl") -> None:
        self.hosts, self.run_dir, self.log, self.host = hosts, run_dir, log, host
        self.proc: subprocess.Popen[bytes] | None = None
        self.pos = 0
        self.last: dict[str, Any] = {}

    def restart(self) -> None:
        self.stop()
        self.last = {}
        self.pos = self.log.stat().st_size if self.log.exists() else 0
        self.proc = self.hosts.spawn(
            self.host, [*JETCTL, "status", "--run-dir", str(self.run_dir), "--json",
                        "--interval", "0.5"], log=self.log, env=env(), cwd=ROOT)

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait(timeout=30)
        self.proc = None

    def __call__(self) -> dict[str, Any]:
        if self.proc is None:
            self.restart()
            return self.last
        exited = self.proc.poll() is not None
        with open(self.log, "rb") as f:
            f.seek(self.pos)
            chunk = f.read()
        complete = chunk[:chunk.rfind(b"\n") + 1]
        self.pos += len(complete)
        for line in complete.splitlines():
            if line.startswith(b"{"):
                try:
                    self.last = json.loads(line)
                except json.JSONDecodeError:  # a line of its error output, not a document
                    pass
        if exited:  # what it wrote before it exited was read above
            self.restart()
        return self.last


def pending(spool: Path) -> int:
    with sqlite3.connect(f"file:{spool}?mode=ro", uri=True) as db:
        return int(db.execute("SELECT COUNT(*) FROM pending").fetchone()[0])


@pytest.mark.timeout(600)
def test_a_run_across_hosts_survives_a_partition_and_balances(
    hosts: Hosts, tmp_path: Path
) -> None:
    dirs = {h: tmp_path / h for h in ("ctl", "srv", "c1", "c2")}
    for d in dirs.values():
        d.mkdir()
    run_dir = dirs["ctl"] / "run"
    recipe = dirs["ctl"] / "recipe.yaml"
    ctl = hosts.addr("ctl")
    recipe.write_text(RECIPE.format(token=TOKEN, port=PORT, ctl=ctl, srv=hosts.addr("srv")))
    join = [f"--join={ctl}:{PORT}", f"--token={TOKEN}", "--tls=tls"]

    controller = hosts.spawn("ctl", [*JETCTL, "up", str(recipe), "--run-dir", str(run_dir)],
                             log=dirs["ctl"] / "up.log", env=env(), cwd=ROOT)
    certs = wait_for(lambda: (run_dir / "tls" / "server.key").is_file() and run_dir / "tls",
                     60, "the run's certificates")
    # what a user copies to each host: the CA, and the server's own certificate
    for host, files in (("srv", ("ca.pem", "server.pem", "server.key")),
                        ("c1", ("ca.pem",)), ("c2", ("ca.pem",))):
        (dirs[host] / "tls").mkdir()
        for name in files:
            shutil.copy(certs / name, dirs[host] / "tls" / name)
    server = hosts.spawn(
        "srv", [*JETCTL, "server", *join, "--model=policy", f"--run-dir={dirs['srv']}",
                f"--tls-dir={dirs['srv'] / 'tls'}"],
        log=dirs["srv"] / "server.log", env=env(), cwd=ROOT,
    )
    clients = {
        h: hosts.spawn(
            h, [*JETCTL, "client", *join, "--task=digits", f"--run-dir={dirs[h]}",
                f"--tls-dir={dirs[h] / 'tls'}", "--drain-grace-s=20"],
            log=dirs[h] / "client.log", env=env(), cwd=ROOT,
        )
        for h in ("c1", "c2")
    }
    watch = StatusWatch(hosts, run_dir, dirs["ctl"] / "status.log")
    try:
        doc = wait_for(
            lambda: (d := watch()) and (d["servers"][0]["version"] or 0) >= 2
            and len([c for c in d["clients"] if c["state"] == "running"]) == 2 and d,
            240, "training with both joined nodes",
        )
        by_host = {c["address"]: c["name"] for c in doc["clients"]}
        assert set(by_host) == {hosts.addr("c1"), hosts.addr("c2")}, doc["clients"]
        assert doc["tasks"]["digits"]["nodes"] == 2, "the controller counts the joined nodes"
        cut_node = by_host[hosts.addr("c1")]
        spool = dirs["c1"] / "spool" / f"{cut_node}.sqlite"

        # the partition: c1 reaches neither the server nor the controller until its node has
        # spooled, the controller shows it unreachable and the trainer went on without it
        version_before = doc["servers"][0]["version"]
        trained_before = doc["servers"][0]["trained_groups"]
        hosts.cut("c1")
        cut_at = time.monotonic()
        wait_for(lambda: pending(spool) >= 2, CUT_S, "c1's node spooling while cut off")
        during = wait_for(
            lambda: (d := watch()) and {
                c["name"]: c["state"] for c in d["clients"]
            }.get(cut_node) == "unreachable" and d,
            CUT_S, "the controller to show c1's node unreachable",
        )
        # the trainer kept consuming the other host's groups (a group without signal is
        # consumed without an optimizer step, so the version alone may stand still)
        after_cut = wait_for(
            lambda: (d := watch()) and d["servers"][0]["trained_groups"] > trained_before and d,
            CUT_S, "training going on with c2 while c1 is cut off",
        )
        spooled_in_cut = pending(spool)
        cut_s = time.monotonic() - cut_at
        hosts.heal("c1")
        assert {c["name"]: c["state"] for c in after_cut["clients"]}[cut_node] == "unreachable"
        assert spooled_in_cut >= 2, "the cut-off node kept rolling out"
        assert during["servers"][0]["version"] >= version_before
        print(f"c1 was cut off for {cut_s:.1f}s")

        healed = wait_for(
            lambda: pending(spool) == 0 and (d := watch()) and {
                c["name"]: c for c in d["clients"]}[cut_node]["state"] == "running" and d,
            CUT_S, "c1's node to deliver its spool and sync again",
        )
        assert {c["name"]: c for c in healed["clients"]}[cut_node]["acks"].get("accepted", 0) > 0

        watch.stop()
        down = hosts.run("ctl", [*JETCTL, "down", "--run-dir", str(run_dir)], env=env(),
                         cwd=ROOT, timeout=120)
        assert down.returncode == 0, down.stdout + down.stderr
        assert controller.wait(timeout=120) == 0
        for h, proc in clients.items():
            assert proc.wait(timeout=60) == 0, (dirs[h] / "client.log").read_text()[-3000:]
        assert server.wait(timeout=60) == 0, (dirs["srv"] / "server.log").read_text()[-3000:]
    finally:
        watch.stop()
        for proc in (controller, server, *clients.values()):
            if proc.poll() is None:
                proc.kill()

    # no shared run dir: the controller's holds no spool and no store
    assert not (run_dir / "spool").exists() and not RunPaths(run_dir).stores()
    ledger = build_ledger(run_dir)
    s = ledger.summary()
    assert s["balanced"], s["problems"]
    assert s["trained"] > 0 and s["awaiting_reports"] == 0
    assert sorted(s["nodes"]) == sorted(by_host.values())
    assert s["in_flight"]["rollout"] == 0, "the drained nodes left no rollout in progress"
    # what `jetctl up` printed at the end: the steps the server on `srv` reported (its step
    # log is in its own folder there)
    summary = finished_summary(run_dir)["models"]["policy"]
    assert summary["steps"] >= int(healed["servers"][0]["version"]), summary
    assert summary["final_reward"] is not None
    # the hosts' own files, put side by side, tell the same story
    view = tmp_path / "view"
    (view / "spool").mkdir(parents=True)
    (view / "server-policy").symlink_to(dirs["srv"] / "server-policy")
    for h in ("c1", "c2"):
        for f in (dirs[h] / "spool").glob("*.sqlite"):
            (view / "spool" / f.name).symlink_to(f)
    assert ledger_from_files(view).summary() == s


def test_a_joining_node_is_refused_with_the_reason(hosts: Hosts, tmp_path: Path) -> None:
    """An unknown task, or a wrong token, is one red line and exit code 1."""
    run_dir = tmp_path / "run"
    recipe = tmp_path / "recipe.yaml"
    ctl = hosts.addr("ctl")
    recipe.write_text(RECIPE.format(token=TOKEN, port=PORT, ctl=ctl, srv=hosts.addr("srv"))
                      .replace("tls: {mode: tls}", "tls: {mode: 'off'}"))
    # --grace 1: at the end it drains a server that never joined, nothing else
    controller = hosts.spawn("ctl", [*JETCTL, "up", str(recipe), "--run-dir", str(run_dir),
                                     "--grace", "1"],
                             log=tmp_path / "up.log", env=env(), cwd=ROOT)
    try:
        wait_for(lambda: (run_dir / "run.json").is_file(), 60, "the controller")
        base = [*JETCTL, "client", f"--join={ctl}:{PORT}"]
        with ThreadPoolExecutor(2) as pool:  # the two refusals at once, from two folders
            wrong_f = pool.submit(hosts.run, "c1", [*base, f"--run-dir={tmp_path / 'c1'}",
                                                    f"--token={TOKEN}", "--task=nope"],
                                  env=env(), cwd=ROOT, timeout=120)
            bad_f = pool.submit(hosts.run, "c2", [*base, f"--run-dir={tmp_path / 'c2'}",
                                                  "--token=wrong", "--task=digits"],
                                env=env(), cwd=ROOT, timeout=120)
            wrong, bad = wrong_f.result(), bad_f.result()
        assert wrong.returncode == 1 and "task 'nope' is not in the run" in wrong.stderr
        assert bad.returncode == 1 and "UNAUTHENTICATED" in bad.stderr
    finally:
        controller.terminate()
        try:
            controller.wait(timeout=60)
        except subprocess.TimeoutExpired:
            controller.kill()
