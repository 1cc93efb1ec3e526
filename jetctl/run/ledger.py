"""The ledger of a run: where every trajectory id ended up, and whether the books balance.

    ledger = build_ledger(Path("runs/tiny"))
    print(ledger.render())          # totals and any problem, for people
    ledger.summary()                # the `ledger` key of `jetctl status --json`
    assert ledger.balanced

Every trajectory id a client node made reaches exactly one outcome (docs/architecture.md
section 6), or is still in flight:

    trained                              a server trained it (at a step that survived)
    rejected(stale | invalid | revision) refused with a reason, at Submit or at batch time
    dropped(timeout | failed | dead-letter | lost)   given up by the client, with the error
    in flight: rollout | client_spool | server_buffer

It joins ids, not counters: each server's store (groups with their trajectory ids,
state, refusal, step; the train log and the epochs of restarts) and each node's spool
(rollouts in progress, pending groups, acked outcomes, dropped trajectories). The one
counter: a spool keeps only its recent acks as rows and folds older ones into totals per
(model, outcome) (jetctl.client.spool `outcome_totals`); a folded ack's ids are the ones a
server holds that no spool names (they would read as `server_only`), and its ids no server
holds count as they would have (rejected with its refusal; lost or awaiting reports when
accepted), so the totals are the same before and after the fold. Those files
live on their nodes' hosts; every change to them is journaled (jetctl.journal) and synced to
the controller, and `build_ledger` reads the controller's copy (`<run_dir>/received.sqlite`,
jetctl.controller.received), so it works across hosts that share no disk, on a live run and
on a stopped one. `ledger_from_files` reads the files themselves (one host).

On a live run the copy trails the nodes by a sync or two: a rollout the copy still shows in
progress while a server already holds its group, or an ack no server's records show yet,
count as `awaiting_reports`, not as problems, until every node has sent its last records
(it does so when it drains).

What unbalances it (each a `Problem`):

* `lost`: a client holds an ack (accepted or duplicate) for a group no server has, or a
  server marked a group trained at a step that a restart threw away and never trained it
  again;
* `trained_twice`: a group trained twice in the history that survived the restarts, or a
  trajectory id trained in two groups;
* `conflict`: an id in two places that exclude each other (dropped by the client and
  stored by a server; in two spools).

A group a server holds while the client still has it pending (its ack was lost, the
client will resend it and hear DUPLICATE) counts once, by the server's state. Ids only a
server knows (its client's spool is gone) are counted under `server_only`.

Every id also counts under its model (`by_model`: a server's row names it, and every spool
row names the model its group is for), so the books of each model of a team balance on their
own: a rollout of a two-model team makes one id per model, each with its own outcome.

Left out: the per-group `max_staleness` arithmetic (the server's reason is taken as given).
"""

from __future__ import annotations

import sqlite3
from collections import Counter
from collections.abc import Iterable, Iterator
from contextlib import closing, contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

from jetctl.rundir import RunPaths

ProblemKind = Literal["lost", "trained_twice", "conflict"]
MAX_PROBLEMS_SHOWN = 20


@dataclass(frozen=True)
class Problem:
    kind: ProblemKind
    trajectory_id: str
    detail: str
    model: str = ""  # the model the id was made for ('' when no record names it)


class LedgerError(ValueError):
    """A store or spool the ledger cannot read (written by an older jetctl)."""


@dataclass(frozen=True)
class _ServerRow:
    model: str
    group_id: str
    state: str  # buffered | trained | rejected
    refusal: str  # stale | invalid | revision when rejected
    detail: str  # why, for people (never parsed)
    step: int | None


@dataclass(frozen=True)
class _ClientFact:
    node: str
    group_id: str
    kind: Literal["rollout", "pending", "outcome", "dropped"]
    detail: str = ""  # outcome (accepted | duplicate | stale | invalid | revision) or drop reason
    reason: str = ""
    behind: bool = False  # its node has not sent every record yet (a live node)
    model: str = ""  # the model its group is for ('' in spools written before teams)


Bucket = Literal["trained", "rejected", "dropped", "in_flight", "awaiting_reports"]


@dataclass
class Ledger:
    """Totals by outcome (trajectories), and what does not add up."""

    trained: int = 0
    rejected: Counter[str] = field(default_factory=Counter)
    dropped: Counter[str] = field(default_factory=Counter)
    in_flight: Counter[str] = field(default_factory=Counter)
    server_only: int = 0
    resent_after_lost_ack: int = 0  # held by a server and still pending on a client
    awaiting_reports: int = 0  # settled by records a live server has not sent yet
    problems: list[Problem] = field(default_factory=list)
    servers: dict[str, dict[str, Any]] = field(default_factory=dict)  # model -> epochs, version
    nodes: list[str] = field(default_factory=list)
    # model -> (bucket, reason) -> trajectories: the same outcomes, per model
    by_model: dict[str, Counter[tuple[str, str]]] = field(default_factory=dict)

    def tally(self, model: str, bucket: Bucket, key: str = "") -> None:
        """Count one id's outcome, in the totals and under its model."""
        if bucket == "trained":
            self.trained += 1
        elif bucket == "awaiting_reports":
            self.awaiting_reports += 1
        else:
            getattr(self, bucket)[key] += 1
        self.by_model.setdefault(model, Counter())[(bucket, key)] += 1

    def problem(self, kind: ProblemKind, tid: str, detail: str, model: str) -> None:
        self.problems.append(Problem(kind, tid, detail, model))
        self.by_model.setdefault(model, Counter())

    @property
    def produced(self) -> int:
        return (
            self.trained + sum(self.rejected.values()) + sum(self.dropped.values())
            + sum(self.in_flight.values()) + self.count("lost") + self.awaiting_reports
        )

    def count(self, kind: ProblemKind) -> int:
        return sum(1 for p in self.problems if p.kind == kind)

    @property
    def balanced(self) -> bool:
        """Nothing lost, nothing trained twice, no id in two exclusive places."""
        return not self.problems

    def summary(self) -> dict[str, Any]:
        """A JSON-ready breakdown (the `ledger` key of `jetctl status --json`)."""
        return {
            "produced": self.produced,
            "trained": self.trained,
            "rejected": dict(sorted(self.rejected.items())),
            "dropped": dict(sorted(self.dropped.items())),
            "in_flight": {k: self.in_flight.get(k, 0)
                          for k in ("rollout", "client_spool", "server_buffer")},
            "server_only": self.server_only,
            "resent_after_lost_ack": self.resent_after_lost_ack,
            "awaiting_reports": self.awaiting_reports,
            "lost": self.count("lost"),
            "trained_twice": self.count("trained_twice"),
            "conflicts": self.count("conflict"),
            "balanced": self.balanced,
            "problems": [
                f"{p.kind} {p.trajectory_id}: {p.detail}"
                for p in self.problems[:MAX_PROBLEMS_SHOWN]
            ],
            "servers": self.servers,
            "nodes": self.nodes,
            "by_model": {m: self.model_summary(m) for m in sorted(self.by_model)},
        }

    def model_summary(self, model: str) -> dict[str, Any]:
        """One model's books: its ids' outcomes, and whether they balance on their own."""
        counts = self.by_model.get(model, Counter())

        def bucket(name: str) -> dict[str, int]:
            return dict(sorted((k, n) for (b, k), n in counts.items() if b == name))

        problems = [p for p in self.problems if p.model == model]
        lost = sum(1 for p in problems if p.kind == "lost")
        return {
            "produced": sum(counts.values()) + lost,
            "trained": counts.get(("trained", ""), 0),
            "rejected": bucket("rejected"),
            "dropped": bucket("dropped"),
            "in_flight": bucket("in_flight"),
            "awaiting_reports": counts.get(("awaiting_reports", ""), 0),
            "lost": lost,
            "problems": len(problems),
            "balanced": not problems,
        }

    def render(self) -> str:
        """A few lines for a terminal."""
        s = self.summary()

        def parts(d: dict[str, int]) -> str:
            return ", ".join(f"{k} {v}" for k, v in d.items() if v) or "none"

        lines = [
            (f"trajectories produced {s['produced']}: trained {s['trained']}, "
            f"rejected {sum(s['rejected'].values())} ({parts(s['rejected'])}), "
            f"dropped {sum(s['dropped'].values())} ({parts(s['dropped'])}), "
            f"in flight {sum(s['in_flight'].values())} ({parts(s['in_flight'])})"),
            (f"lost {s['lost']}, trained twice {s['trained_twice']}, conflicts {s['conflicts']}"
            f"; acks lost and resent {s['resent_after_lost_ack']}, server only {s['server_only']}"),
        ]
        for model, info in s["servers"].items():
            epochs = info.get("epochs") or []
            resumed = ", ".join(str(e["resumed_from"]) for e in epochs[1:]) or "-"
            lines.append(
                f"server {model}: {len(epochs)} start(s), resumed from versions {resumed}"
            )
        if len(s["by_model"]) > 1:  # a team: each model's books on their own line
            for model, b in s["by_model"].items():
                lines.append(
                    f"model {model or '?'}: produced {b['produced']}, trained {b['trained']}, "
                    f"rejected {sum(b['rejected'].values())}, dropped "
                    f"{sum(b['dropped'].values())}, in flight {sum(b['in_flight'].values())}, "
                    f"lost {b['lost']}: {'balanced' if b['balanced'] else 'NOT BALANCED'}"
                )
        lines += [f"  {p}" for p in s["problems"]]
        lines.append("BALANCED: every id has exactly one outcome or is in flight"
                     if self.balanced else "NOT BALANCED")
        return "\n".join(lines)


# -- what the ledger reads: rows of the stores and facts of the spools --------------------


def _ids(joined: str, group_id: str, n: int) -> list[str]:
    # rows written before ids were recorded: stand-in ids that match across both sides
    return joined.split(",") if joined else [f"{group_id}#{i}" for i in range(n)]


GroupRow = tuple[str, int, str, str, str, "int | None", str]  # id, n, state, refusal, reason,
# step, ids


def _store_rows(
    model: str, rows: Iterable[GroupRow], epochs: list[tuple[int, int]],
    log: list[tuple[str, int, int]], ledger: Ledger,
) -> dict[str, list[_ServerRow]]:
    """Trajectory id -> the server rows that hold it, from one server's groups, epochs and
    train log."""
    rows = list(rows)
    by_id: dict[str, list[_ServerRow]] = {}
    surviving = _surviving_steps(epochs, log)
    ledger.servers[model] = {
        "epochs": [{"epoch": e, "resumed_from": r} for e, r in sorted(epochs)],
        "groups": len(rows),
    }
    for gid, n, state, refusal, reason, step, joined in rows:
        kept = surviving.get(gid, [])
        if len(kept) > 1:
            for tid in _ids(joined, gid, n):
                ledger.problem(
                    "trained_twice", tid,
                    f"group {gid} on {model} trained at steps {kept} of the surviving history",
                    model,
                )
        if state == "trained" and log and not kept:
            # marked trained only at steps a restart discarded: its gradient is gone
            state, reason = "lost_history", f"trained at step {step} which a restart discarded"
        for tid in _ids(joined, gid, n):
            by_id.setdefault(tid, []).append(_ServerRow(model, gid, state, refusal, reason, step))
    return by_id


def _surviving_steps(
    epochs: list[tuple[int, int]], log: list[tuple[str, int, int]]
) -> dict[str, list[int]]:
    """Steps per group that the final model's history contains: an epoch's steps past the
    version the next epoch resumed from were lost (min over all later epochs)."""
    ceiling: dict[int, float] = {}
    later_min = float("inf")
    for epoch, resumed_from in sorted(epochs, reverse=True):
        ceiling[epoch] = later_min
        later_min = min(later_min, resumed_from)
    out: dict[str, list[int]] = {}
    for gid, step, epoch in log:
        if step <= ceiling.get(epoch, float("inf")):
            out.setdefault(gid, []).append(step)
    return out


@dataclass
class _SpoolFacts:
    # each row ends with the model its group is for ('' in spools written before teams)
    inflight: list[tuple[str, str, str]] = field(default_factory=list)  # trajectory, group id
    pending: list[tuple[str, int, str, str]] = field(default_factory=list)  # group, n, ids
    outcomes: list[tuple[str, int, str, str, str, str]] = field(
        default_factory=list
    )  # group, n, outcome, reason, ids
    dropped: list[tuple[str, str, str]] = field(default_factory=list)  # trajectory id, reason
    folded: list[tuple[str, str, int]] = field(default_factory=list)  # model, outcome, ids


def _spool_facts(node: str, spool: _SpoolFacts, behind: bool) -> dict[str, list[_ClientFact]]:
    by_id: dict[str, list[_ClientFact]] = {}

    def add(tid: str, fact: _ClientFact) -> None:
        by_id.setdefault(tid, []).append(fact)

    for tid, gid, model in spool.inflight:
        add(tid, _ClientFact(node, gid, "rollout", behind=behind, model=model))
    for gid, n, joined, model in spool.pending:
        for tid in _ids(joined, gid, n):
            add(tid, _ClientFact(node, gid, "pending", behind=behind, model=model))
    for gid, n, outcome, reason, joined, model in spool.outcomes:
        for tid in _ids(joined, gid, n):
            add(tid, _ClientFact(node, gid, "outcome", outcome, reason, behind, model))
    for tid, reason, model in spool.dropped:
        add(tid, _ClientFact(node, "", "dropped", reason, behind=behind, model=model))
    return by_id


# -- from what the controller received (jetctl.controller.received) ----------------------


def build_ledger(run_dir: Path) -> Ledger:
    """The ledger of a run from what its controller received of every node's journal
    (`<run_dir>/received.sqlite`): it balances across hosts that share no disk. Ids whose
    outcome depends on records a live node has not sent yet count as `awaiting_reports`."""
    from jetctl.controller.received import Received

    path = RunPaths(Path(run_dir)).received
    if not path.is_file():
        return Ledger()
    received = Received(path)
    try:
        servers, clients = received.journals("server"), received.journals("client")
    finally:
        received.close()
    ledger = Ledger()
    server: dict[str, list[_ServerRow]] = {}
    for j in sorted(servers.values(), key=lambda j: j.name):
        t = j.tables
        rows = [
            (k, int(g["n_traj"]), str(g["state"]), str(g.get("refusal") or ""),
             str(g.get("reason") or ""), g.get("step"), str(g.get("trajectory_ids") or ""))
            for k, g in (t.get("groups") or {}).items()
        ]
        epochs = [(int(k), int(e["resumed_from"])) for k, e in (t.get("epochs") or {}).items()]
        log = [(str(r["group_id"]), int(r["step"]), int(r["epoch"]))
               for r in (t.get("train_log") or {}).values()]
        for tid, found in _store_rows(j.name, rows, epochs, log, ledger).items():
            server.setdefault(tid, []).extend(found)
    client: dict[str, list[_ClientFact]] = {}
    folded: list[tuple[str, str, int]] = []
    for j in sorted(clients.values(), key=lambda j: j.name):
        t = j.tables
        spool = _SpoolFacts(
            inflight=[(k, str(r["group_id"]), _model(r))
                      for k, r in (t.get("inflight") or {}).items()],
            pending=[(k, int(r["n_trajectories"]), str(r.get("trajectory_ids") or ""), _model(r))
                     for k, r in (t.get("pending") or {}).items()],
            outcomes=[(k, int(r["n_trajectories"]), str(r["outcome"]), str(r["reason"]),
                       str(r.get("trajectory_ids") or ""), _model(r))
                      for k, r in (t.get("outcomes") or {}).items()],
            dropped=[(k, str(r["reason"]), _model(r))
                     for k, r in (t.get("dropped") or {}).items()],
            folded=[(_model(r), str(r["outcome"]), int(r["trajectories"]))
                    for r in (t.get("outcome_totals") or {}).values()],
        )
        ledger.nodes.append(j.name)
        folded += spool.folded
        for tid, facts in _spool_facts(j.name, spool, behind=not j.final).items():
            client.setdefault(tid, []).extend(facts)
    servers_behind = any(not j.final for j in servers.values())
    for tid in server.keys() | client.keys():
        _classify(tid, server.get(tid, []), client.get(tid, []), ledger, servers_behind)
    _count_folded(folded, server, client, ledger, servers_behind)
    return ledger


def _model(row: dict[str, Any]) -> str:
    """The model a spool row's group is for ('' from a node that predates teams)."""
    return str(row.get("model") or "")


# -- from the files themselves (one host: tests, a run dir copied whole) ------------------


@contextmanager
def _read_only(path: Path) -> Iterator[sqlite3.Connection]:
    """A read-only connection that sees committed WAL data of a live writer."""
    with closing(sqlite3.connect(f"file:{path}?mode=ro", uri=True, timeout=10.0)) as db:
        yield db


def _columns(db: sqlite3.Connection, table: str) -> set[str]:
    return {r[1] for r in db.execute(f"PRAGMA table_info({table})")}


def _tables(db: sqlite3.Connection) -> set[str]:
    return {r[0] for r in db.execute("SELECT name FROM sqlite_master WHERE type='table'")}


def _read_store(model: str, path: Path, ledger: Ledger) -> dict[str, list[_ServerRow]]:
    with _read_only(path) as db:
        cols = _columns(db, "groups")
        if "refusal" not in cols:
            raise LedgerError(
                f"{path} was written by an older jetctl (its refusals have no column): start "
                "its server once with this version (jetctl up --resume) to migrate it"
            )
        ids_col = "trajectory_ids" if "trajectory_ids" in cols else "''"
        rows = db.execute(
            f"SELECT id, n_traj, state, refusal, reason, step, {ids_col} FROM groups"
        ).fetchall()
        tables = _tables(db)
        epochs = (
            db.execute("SELECT epoch, resumed_from FROM epochs ORDER BY epoch").fetchall()
            if "epochs" in tables else []
        )
        log = (
            db.execute("SELECT group_id, step, epoch FROM train_log").fetchall()
            if "train_log" in tables else []
        )
    return _store_rows(model, rows, epochs, log, ledger)


def _read_spool(
    node: str, path: Path, folded: list[tuple[str, str, int]]
) -> dict[str, list[_ClientFact]]:
    """The spool's facts by trajectory id; its folded acks are appended to `folded`."""
    spool = _SpoolFacts()
    with _read_only(path) as db:
        def col(table: str, name: str) -> str:  # a column older spools lack reads as ''
            return name if name in _columns(db, table) else "''"

        if "inflight" in _tables(db):
            spool.inflight = db.execute(
                f"SELECT trajectory_id, group_id, {col('inflight', 'model')} FROM inflight"
            ).fetchall()
        spool.pending = db.execute(
            f"SELECT id, n_trajectories, {col('pending', 'trajectory_ids')},"
            f" {col('pending', 'model')} FROM pending"
        ).fetchall()
        spool.outcomes = db.execute(
            f"SELECT group_id, n_trajectories, outcome, reason,"
            f" {col('outcomes', 'trajectory_ids')}, {col('outcomes', 'model')} FROM outcomes"
        ).fetchall()
        spool.dropped = db.execute(
            f"SELECT trajectory_id, reason, {col('dropped', 'model')} FROM dropped"
        ).fetchall()
        if "outcome_totals" in _tables(db):
            folded += db.execute("SELECT model, outcome, trajectories FROM outcome_totals")
    return _spool_facts(node, spool, behind=False)


def ledger_from_files(run_dir: Path) -> Ledger:
    """The ledger from the stores and spools under `run_dir` themselves (a run on one host,
    or its files copied together); `build_ledger` is what the controller received."""
    paths = RunPaths(Path(run_dir))
    ledger = Ledger()
    server: dict[str, list[_ServerRow]] = {}
    for model, path in paths.stores().items():
        for tid, rows in _read_store(model, path, ledger).items():
            server.setdefault(tid, []).extend(rows)
    client: dict[str, list[_ClientFact]] = {}
    folded: list[tuple[str, str, int]] = []
    for node, path in paths.spools().items():
        ledger.nodes.append(node)
        for tid, facts in _read_spool(node, path, folded).items():
            client.setdefault(tid, []).extend(facts)
    for tid in server.keys() | client.keys():
        _classify(tid, server.get(tid, []), client.get(tid, []), ledger, False)
    _count_folded(folded, server, client, ledger, False)
    return ledger



# -- balancing --------------------------------------------------------------------------


def _classify(
    tid: str, rows: list[_ServerRow], facts: list[_ClientFact], ledger: Ledger,
    servers_behind: bool,
) -> None:
    """One id's outcome. `servers_behind`: some server's records are still to come (a live
    run), so what only their next records could settle awaits them instead of being a
    problem; a client fact that is `behind` likewise (its node has not sent everything)."""
    # the model it was made for: a server's row names it; else the spool's ('' if old)
    model = rows[0].model if rows else next((f.model for f in facts if f.model), "")
    if len(rows) > 1:
        trained = [r for r in rows if r.state == "trained"]
        kind: ProblemKind = "trained_twice" if len(trained) > 1 else "conflict"
        where = ", ".join(f"{r.model}/{r.group_id} ({r.state})" for r in rows)
        ledger.problem(kind, tid, f"in {len(rows)} server groups: {where}", model)
    if rows:
        row = rows[0]
        for f in facts:
            if f.kind == "rollout" and f.behind:
                continue  # the node's records of its later state are still to come
            if f.kind in ("rollout", "dropped") or (f.kind == "outcome" and f.detail == "invalid"):
                ledger.problem(
                    "conflict", tid,
                    f"{row.model} holds it ({row.state}) but {f.node} has it {f.kind} {f.detail}",
                    model,
                )
        if not facts:
            ledger.server_only += 1
        elif all(f.kind == "pending" for f in facts):
            ledger.resent_after_lost_ack += 1
        if row.state == "trained":
            ledger.tally(model, "trained")
        elif row.state == "rejected":
            ledger.tally(model, "rejected", row.refusal)
        elif row.state == "buffered":
            ledger.tally(model, "in_flight", "server_buffer")
        elif servers_behind:
            ledger.tally(model, "awaiting_reports")
        else:
            ledger.problem("lost", tid, f"{row.model}: {row.detail}", model)
        return
    if len(facts) > 1:
        where = ", ".join(f"{f.node}:{f.kind} {f.detail}".strip() for f in facts)
        ledger.problem("conflict", tid, f"in {len(facts)} places: {where}", model)
    f = facts[0]
    if f.kind == "rollout":
        ledger.tally(model, "in_flight", "rollout")
    elif f.kind == "pending":
        ledger.tally(model, "in_flight", "client_spool")
    elif f.kind == "dropped":
        ledger.tally(model, "dropped", f.detail)
    elif f.detail in ("accepted", "duplicate") and servers_behind:
        ledger.tally(model, "awaiting_reports")  # acked; the server's record is still to come
    elif f.detail in ("accepted", "duplicate"):
        ledger.problem(
            "lost", tid, f"{f.node} holds ack {f.detail} for group {f.group_id}; no server has it",
            model,
        )
    else:
        ledger.tally(model, "rejected", f.detail)


def _count_folded(
    folded: list[tuple[str, str, int]], server: dict[str, list[_ServerRow]],
    client: dict[str, list[_ClientFact]], ledger: Ledger, servers_behind: bool,
) -> None:
    """Count the acks spools folded into totals (model, outcome, trajectories), after
    `_classify` counted every id: a folded ack's ids that a server holds were classified by
    the server's row and read as `server_only` (no spool names them any more), so they
    leave `server_only`; those no server holds count as the spool's row would have made
    them count. A server stores every group it answers for but an invalid one (which is
    never matched: it counts as rejected), and acks are matched first."""
    if not folded:
        return
    unnamed = Counter(rows[0].model for tid, rows in server.items() if tid not in client)

    def held(model: str, n: int) -> int:  # a spool from before teams ('') matches any model
        got = 0
        for m in [model] if model else list(unnamed):
            take = min(n - got, unnamed[m])
            unnamed[m] -= take
            got += take
        return got

    for model, outcome, n in sorted(folded, key=lambda f: f[1] not in ("accepted", "duplicate")):
        found = 0 if outcome == "invalid" else held(model, n)
        ledger.server_only -= found
        for _ in range(n - found):
            if outcome not in ("accepted", "duplicate"):
                ledger.tally(model, "rejected", outcome)
            elif servers_behind:
                ledger.tally(model, "awaiting_reports")
            else:
                ledger.problem(
                    "lost", "(folded)",
                    f"a spool holds a folded {outcome} ack of {model}; no server has its ids",
                    model,
                )
