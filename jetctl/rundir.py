"""The run directory: where each file lives (docs/CONTRACTS.md), atomic writes, the token,
finding a run, and typed readers of the records the tools read back.

One module owns these facts; the controller, the server, the client node, chaos, the ledger
and the CLI import it (it imports nothing of theirs):

    paths = RunPaths(Path("runs/tiny"))
    paths.store("policy")              # runs/tiny/server-policy/store.sqlite
    write_json_atomic(paths.server_file("policy"), {...})
    token = read_token_for(paths.root)  # $JETCTL_TOKEN, else runs/tiny/token
    read_run_record(paths.root).controller  # run.json, typed: a missing field names the file

The readers (`read_run_record`, `read_server_file`, `read_step_rows`) build small frozen
dataclasses of the fields their readers use, in one place, and raise `RecordError` naming
the file and the field when one is missing. Left out: the controller's own re-reading of
run.json on `--resume` (jetctl.controller.state), and the nodes' files (`nodes/<node>.json`,
a node's free-form status).

Every `jetctl` command that acts on a run (`status`, `down`, `up --resume`) finds it with
`find_run_dir`: `--run-dir` if given, else `runs/latest`, else the newest `runs/*/run.json`.
"""

from __future__ import annotations

import json
import os
import threading
import time
from collections.abc import Callable, Iterator, Mapping
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TypeVar

from jetctl import auth

TOKEN_ENV = "JETCTL_TOKEN"


class RunDirError(Exception):
    """A run dir problem the user can fix (no run, no token, a controller already running)."""


class RecordError(RunDirError):
    """A run-dir record (run.json, servers/<model>.json, a step row) that is missing, or that
    lacks a field its reader needs; the message names the file and the field."""


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
        """`jetctl eval`'s figures of each checkpoint (jetctl.run.eval; a task's in-run eval,
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
    """run.json as a raw dict, every field the controller wrote (the tests read fields the
    commands do not need through it; the commands read `read_run_record`)."""
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


# -- typed records ------------------------------------------------------------------------

T = TypeVar("T")


def _need(data: Mapping[str, Any], key: str, kind: Callable[[Any], T], where: str) -> T:
    """`data[key]` as `kind`; RecordError naming `where` and `key` when it is missing or null."""
    value = data.get(key)
    if value is None:
        raise RecordError(f"{where} has no {key!r} (docs/CONTRACTS.md lists what it holds)")
    return _as(value, key, kind, where)


def _maybe(data: Mapping[str, Any], key: str, kind: Callable[[Any], T], where: str) -> T | None:
    """`data[key]` as `kind`, None when it is missing or null (a field written only sometimes)."""
    value = data.get(key)
    return None if value is None else _as(value, key, kind, where)


def _as(value: Any, key: str, kind: Callable[[Any], T], where: str) -> T:
    try:
        return kind(value)
    except (TypeError, ValueError):
        what = getattr(kind, "__name__", str(kind))
        raise RecordError(f"{where}: {key!r} is {value!r}, expected {what}") from None


def _section(data: Mapping[str, Any], key: str, where: str) -> dict[str, Any]:
    """The JSON object under `key` ({} when it is missing or null)."""
    value = data.get(key) or {}
    if not isinstance(value, dict):
        raise RecordError(f"{where}: {key!r} is {value!r}, not an object")
    return value


def _entries(
    data: Mapping[str, Any], key: str, where: str
) -> Iterator[tuple[str, dict[str, Any]]]:
    """(name, object) of each entry of the object under `key` (`servers`, `clients`)."""
    for name, entry in _section(data, key, where).items():
        if not isinstance(entry, dict):
            raise RecordError(f"{where}: {key}.{name} is {entry!r}, not an object")
        yield name, entry


@dataclass(frozen=True)
class ControllerRecord:
    """run.json's `controller`: the process a command reaches the run through."""

    pid: int
    endpoint: str  # host:port of its Control service
    create_time: float  # the process's start time (a recycled pid is not it); 0.0: not recorded


@dataclass(frozen=True)
class TrainedRecord:
    """run.json's `servers.<model>.trained`: what the controller last heard of the model's
    training over the network (jetctl.controller.state.trained); None before the first word."""

    version: int | None = None  # optimizer steps
    reward_mean_recent: float | None = None
    trained_groups: int | None = None
    last_checkpoint_version: int | None = None


@dataclass(frozen=True)
class ClientRecord:
    """run.json's `clients.<node>`."""

    task: str
    revision: str
    pid: int | None  # a process node's; None for a container, a Ray actor, a node that joined


@dataclass(frozen=True)
class RunRecord:
    """run.json (docs/CONTRACTS.md; jetctl.controller.state writes it): the fields that
    `jetctl status` and the tests read back."""

    run: str  # run.name; a re-train's run.json (jetctl.run.rerun) has none: its dir's name
    recipe: str  # the recipe's absolute path
    state: str  # starting | running | stopping | finished (jetctl.controller.state.RunPhase)
    controller: ControllerRecord | None  # None: no controller (a re-train, jetctl.run.rerun)
    trained: dict[str, TrainedRecord]  # model -> its `servers.<model>.trained`, every server
    server_endpoints: dict[str, str]  # model -> `servers.<model>.endpoint` (host:port), once set
    clients: dict[str, ClientRecord]  # node -> its entry
    tls: dict[str, Any] | None  # jetctl.tls.TlsFiles.from_json reads it (tls imports this)
    started_at: float | None = None  # unix seconds
    finished_at: float | None = None  # unix seconds, once finished
    stop_reason: str | None = None  # once it ends

    @classmethod
    def from_json(cls, data: Mapping[str, Any], path: Path) -> RunRecord:
        where = str(path)
        ctl = _section(data, "controller", where)
        controller: ControllerRecord | None = None
        if ctl:
            at = f"{where} (controller)"
            controller = ControllerRecord(
                pid=_need(ctl, "pid", int, at), endpoint=_need(ctl, "endpoint", str, at),
                create_time=_maybe(ctl, "create_time", float, at) or 0.0)
        trained: dict[str, TrainedRecord] = {}
        endpoints: dict[str, str] = {}
        for model, entry in _entries(data, "servers", where):
            endpoint = _maybe(entry, "endpoint", str, f"{where} (servers.{model})")
            if endpoint:
                endpoints[model] = endpoint
            at = f"{where} (servers.{model}.trained)"
            heard = _section(entry, "trained", at)
            trained[model] = TrainedRecord(
                version=_maybe(heard, "version", int, at),
                reward_mean_recent=_maybe(heard, "reward_mean_recent", float, at),
                trained_groups=_maybe(heard, "trained_groups", int, at),
                last_checkpoint_version=_maybe(heard, "last_checkpoint_version", int, at))
        clients: dict[str, ClientRecord] = {}
        for node, entry in _entries(data, "clients", where):
            at = f"{where} (clients.{node})"
            clients[node] = ClientRecord(task=_need(entry, "task", str, at),
                                         revision=_need(entry, "revision", str, at),
                                         pid=_maybe(entry, "pid", int, at))
        return cls(
            run=_maybe(data, "run", str, where) or path.parent.name,
            recipe=_need(data, "recipe", str, where),
            state=_need(data, "state", str, where),
            controller=controller, trained=trained, server_endpoints=endpoints, clients=clients,
            tls=_section(data, "tls", where) or None,
            started_at=_maybe(data, "started_at", float, where),
            finished_at=_maybe(data, "finished_at", float, where),
            stop_reason=_maybe(data, "stop_reason", str, where),
        )


def read_run_record(run_dir: Path) -> RunRecord:
    """run.json of `run_dir`, typed; RunDirError when there is none, RecordError (one) naming
    the file and the field when a field is missing."""
    path = RunPaths(Path(run_dir)).run_json
    data = read_json(path)
    if data is None:
        raise RunDirError(f"{run_dir} has no readable run.json: is it a jetctl run dir?")
    return RunRecord.from_json(data, path)


def peek_run_record(run_dir: Path) -> RunRecord | None:
    """run.json typed, or None where it is missing, unreadable or lacks a field: for the
    commands that poll a run that is starting (`up --detach`) or that may have none yet (a
    study's trials, chaos)."""
    try:
        return read_run_record(run_dir)
    except RunDirError:
        return None


def mark_run_finished(run_dir: Path, reason: str) -> bool:
    """Set run.json's state to finished, with `reason` and the time, for a run whose
    controller is gone (`jetctl down` of an orphaned run). Every other field is the
    controller's (jetctl.controller.state writes run.json); this is the one edit made without
    it. False where there is no run.json."""
    path = RunPaths(Path(run_dir)).run_json
    data = read_json(path)
    if data is None:
        return False
    data.update(state="finished", stop_reason=reason, finished_at=time.time())
    write_json_atomic(path, data)
    return True


@dataclass(frozen=True)
class ServerFile:
    """`servers/<model>.json`: a serving server's addresses, for tools on its host."""

    model: str
    endpoint: str  # host:port of its gRPC service (advertised)
    metrics: str  # host:port of its Prometheus /metrics
    pid: int
    version: int  # the model version when it was written


def read_server_file(run_dir: Path, model: str) -> ServerFile:
    """`model`'s servers/<model>.json, typed; RecordError when it is missing (the server has
    not started serving) or lacks a field."""
    path = RunPaths(Path(run_dir)).server_file(model)
    data = read_json(path)
    if data is None:
        raise RecordError(f"{path} is missing: {model}'s server has not started serving")
    where = str(path)
    return ServerFile(model=_need(data, "model", str, where),
                      endpoint=_need(data, "endpoint", str, where),
                      metrics=_need(data, "metrics", str, where),
                      pid=_need(data, "pid", int, where),
                      version=_need(data, "version", int, where))


@dataclass(frozen=True)
class StepRow:
    """One row of a trainer's step log (`metrics/<model>.steps.jsonl`, written by
    jetctl.server.trainer): the figures every row has, typed; any other figure by the log's
    own name, `row["cost/usd"]`, `"eval/rows/step" in row` (the namespaced metric keys the
    trackers get). A re-train's rows (jetctl.run.rerun) hold other figures: not read here."""

    step: int  # the model version after the row's batch (= optimizer steps)
    stepped: bool  # the batch made an optimizer step (one without signal makes none)
    time: float  # unix seconds
    reward_mean: float  # "reward/mean": every trajectory consumed, skipped groups' too
    groups: int  # groups trained on
    trajectories: int
    groups_skipped: int  # "groups/skipped": consumed without signal, not trained on
    trajectories_skipped: int
    figures: Mapping[str, Any] = field(repr=False)  # the whole row, by the log's names

    def __getitem__(self, name: str) -> Any:
        return self.figures[name]

    def __contains__(self, name: object) -> bool:
        return name in self.figures

    @classmethod
    def from_json(cls, row: Mapping[str, Any], where: str) -> StepRow:
        return cls(
            step=_need(row, "step", int, where), stepped=bool(_need(row, "stepped", float, where)),
            time=_need(row, "time", float, where),
            reward_mean=_need(row, "reward/mean", float, where),
            groups=_need(row, "groups", int, where),
            trajectories=_need(row, "trajectories", int, where),
            groups_skipped=_need(row, "groups/skipped", int, where),
            trajectories_skipped=_need(row, "trajectories/skipped", int, where),
            figures=row,
        )


def read_step_rows(path: Path) -> list[StepRow]:
    """The rows of a step log up to its last whole line (after the last newline: a row being
    written); [] when there is no log yet. RecordError naming the line when one is not a row."""
    if not Path(path).is_file():
        return []
    rows: list[StepRow] = []
    for n, line in enumerate(Path(path).read_text().split("\n")[:-1], start=1):
        if not line.strip():
            continue
        where = f"{path} line {n}"
        try:
            row = json.loads(line)
        except ValueError:
            raise RecordError(f"{where} is not JSON: {line[:80]!r}") from None
        if not isinstance(row, dict):
            raise RecordError(f"{where} is not a JSON object: {line[:80]!r}")
        rows.append(StepRow.from_json(row, where))
    return rows
