"""What the trajectory explorer reads: a run's stores, spools, step logs and checkpoints,
read-only and in bounded queries, so a page never slows a live server's ingest.

    run = RunView(Path("runs/tiny"))
    run.groups(GroupFilter(task="digits", fate="stale", limit=50))
    run.group("policy", group_id)          # members decoded, or None
    run.trace(trajectory_id)               # lineage of one trajectory

Every connection is `file:...?mode=ro` (sqlite's own read-only mode: it sees the committed
WAL of a live writer and takes no write lock); row lists carry a LIMIT; the one scan that
decodes payloads (full-text search) stops after `SEARCH_SCAN` groups.

What the stores do not keep, and this module says so rather than guessing:
- a trained group's payload (tokens, logprobs, versions per turn, node, task row) is dropped
  once the checkpoint that `checkpoint.keep_trained_groups` picks holds its step
  (`TrajectoryStore.forget_payloads`: by default the oldest checkpoint kept, so the steps
  after it still show their groups; `all` keeps every payload; 1 drops them at the newest),
  and a refused group's at refusal; such a group shows its facts only (task, lag,
  revisions, reward);
- a group consumed without signal (zero reward variance) is marked `trained` at the
  version it was consumed at, like a trained one: with its payload the rewards tell the two
  apart; without it the page says it cannot;
- a failed trajectory never reaches a store: its node's spool keeps its id, reason and error
  (`dropped`), not its calls.
"""

from __future__ import annotations

import json
import re
import sqlite3
from collections.abc import Iterator
from contextlib import closing, contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

from jetctl.proto.convert import group_from_bytes
from jetctl.rundir import RunPaths, read_json
from jetctl.types import TrajectoryGroup

Fate = Literal["trained", "buffered", "stale", "invalid", "revision"]
FATES: tuple[Fate, ...] = ("trained", "buffered", "stale", "invalid", "revision")
MAX_ROWS = 500  # rows one list query returns at most
SEARCH_SCAN = 2000  # groups with payloads one full-text search decodes at most
CHECKPOINT_DIR = re.compile(r"^step-(\d+)$")


@contextmanager
def read_only(path: Path) -> Iterator[sqlite3.Connection]:
    """A read-only connection (sqlite `mode=ro`): sees a live writer's committed WAL, never
    blocks it."""
    with closing(sqlite3.connect(f"file:{path}?mode=ro", uri=True, timeout=5.0)) as db:
        yield db


@dataclass(frozen=True)
class GroupFilter:
    """What the group list shows (every field optional)."""

    model: str | None = None
    task: str | None = None
    fate: Fate | None = None
    revision: str | None = None
    reward_min: float | None = None
    reward_max: float | None = None
    version_min: int | None = None  # on a group's oldest call version
    version_max: int | None = None
    step: int | None = None  # the step that marked it trained
    search: str | None = None  # text in a member's completion (needs the payload)
    limit: int = 100


@dataclass(frozen=True)
class GroupRow:
    """One group's facts as its store keeps them (no payload)."""

    model: str
    id: str
    task: str
    n_trajectories: int
    min_version: int
    state: str  # buffered | trained | rejected
    refusal: str
    reason: str
    step: int | None
    received_at: float
    revisions: tuple[str, ...]
    reward_mean: float
    has_payload: bool
    trajectory_ids: tuple[str, ...]

    @property
    def fate(self) -> str:
        """What became of it, for people."""
        if self.state == "trained":
            return f"trained at step {self.step}"
        if self.state == "rejected":
            return f"refused as {self.refusal}: {self.reason}"
        return "buffered (waiting to be trained)"

    @property
    def lag(self) -> int | None:
        """The step that trained it minus its oldest call's version."""
        return None if self.step is None else self.step - self.min_version

    def json(self) -> dict[str, Any]:
        return {
            "model": self.model, "id": self.id, "task": self.task,
            "n_trajectories": self.n_trajectories, "min_version": self.min_version,
            "state": self.state, "refusal": self.refusal, "reason": self.reason,
            "step": self.step, "received_at": self.received_at,
            "revisions": list(self.revisions), "reward_mean": self.reward_mean,
            "has_payload": self.has_payload, "fate": self.fate, "lag": self.lag,
            "trajectory_ids": list(self.trajectory_ids),
        }


_COLUMNS = (
    "id, task, n_traj, min_version, state, refusal, reason, step, received_at, revisions, "
    "reward_sum / MAX(n_traj, 1), payload IS NOT NULL, trajectory_ids"
)


def _row(model: str, r: tuple[Any, ...]) -> GroupRow:
    return GroupRow(
        model=model, id=r[0], task=r[1], n_trajectories=int(r[2]), min_version=int(r[3]),
        state=r[4], refusal=r[5], reason=r[6], step=None if r[7] is None else int(r[7]),
        received_at=float(r[8]), revisions=tuple(x for x in r[9].split(",") if x),
        reward_mean=float(r[10]), has_payload=bool(r[11]),
        trajectory_ids=tuple(x for x in r[12].split(",") if x),
    )


def _where(f: GroupFilter) -> tuple[str, list[Any]]:
    clauses: list[str] = []
    args: list[Any] = []
    if f.task:
        clauses.append("task = ?")
        args.append(f.task)
    if f.fate in ("trained", "buffered"):
        clauses.append("state = ?")
        args.append(f.fate)
    elif f.fate:
        clauses.append("state = 'rejected' AND refusal = ?")
        args.append(f.fate)
    if f.revision:  # revisions is comma-separated
        clauses.append("(',' || revisions || ',') LIKE ?")
        args.append(f"%,{f.revision},%")
    if f.reward_min is not None:
        clauses.append("reward_sum / MAX(n_traj, 1) >= ?")
        args.append(f.reward_min)
    if f.reward_max is not None:
        clauses.append("reward_sum / MAX(n_traj, 1) <= ?")
        args.append(f.reward_max)
    if f.version_min is not None:
        clauses.append("min_version >= ?")
        args.append(f.version_min)
    if f.version_max is not None:
        clauses.append("min_version <= ?")
        args.append(f.version_max)
    if f.step is not None:
        clauses.append("state = 'trained' AND step = ?")
        args.append(f.step)
    return (" WHERE " + " AND ".join(clauses)) if clauses else "", args


@dataclass
class Member:
    """One trajectory of an opened group, with what the trainer made of it."""

    trajectory: Any  # jetctl.types.Trajectory
    advantage: float
    trained: bool  # its completion tokens were in a step (mask 1)


@dataclass
class OpenedGroup:
    row: GroupRow
    group: TrajectoryGroup | None  # None: payload dropped (see module docstring)
    members: list[Member] = field(default_factory=list)
    zero_variance: bool | None = None  # None: unknown (no payload)
    advantage_name: str = "grpo"


@dataclass
class Trace:
    """The lineage of one trajectory id (`jetctl trace`)."""

    trajectory_id: str
    model: str = ""
    row: GroupRow | None = None
    task_id: str = ""
    node: str = ""
    revision: str = ""
    versions: list[int] = field(default_factory=list)  # per turn (call)
    status: str = ""
    error: str = ""
    verdict: str = ""  # admission verdict (accepted, or the refusal)
    step: int | None = None
    checkpoint: str = ""
    notes: list[str] = field(default_factory=list)  # what could not be known, and why

    def json(self) -> dict[str, Any]:
        return {
            "trajectory_id": self.trajectory_id, "model": self.model,
            "group": None if self.row is None else self.row.json(),
            "task_id": self.task_id, "node": self.node, "revision": self.revision,
            "versions": self.versions, "status": self.status, "error": self.error,
            "verdict": self.verdict, "step": self.step, "checkpoint": self.checkpoint,
            "notes": self.notes,
        }

    def render(self) -> str:
        """Lines for the terminal."""
        g = self.row
        lines = [f"trajectory {self.trajectory_id}"]
        if g is not None:
            lines += [f"  model      {self.model}", f"  group      {g.id}",
                      f"  task       {g.task}" + (f" row {self.task_id}" if self.task_id else "")]
        lines += [
            f"  node       {self.node or '?'}",
            f"  revision   {self.revision or '?'}",
            f"  versions   {', '.join(map(str, self.versions)) or '?'} (per turn)",
        ]
        if self.status:
            lines.append(f"  status     {self.status}" + (f": {self.error}" if self.error else ""))
        lines += [
            f"  admission  {self.verdict or '?'}",
            f"  step       {'-' if self.step is None else self.step}",
            f"  checkpoint {self.checkpoint or '-'}",
        ]
        lines += [f"  note: {n}" for n in self.notes]
        return "\n".join(lines)


class RunView:
    """Read-only views of one run dir's stores, spools, step logs and checkpoints."""

    def __init__(self, run_dir: Path) -> None:
        self.paths = RunPaths(Path(run_dir))
        self._recipe: Any | None = None
        self._recipe_read = False
        self._texts: dict[str, Texts] = {}

    # -- groups --------------------------------------------------------------------------

    def models(self) -> list[str]:
        return sorted(self.paths.stores())

    def tasks(self) -> list[str]:
        found: set[str] = set()
        for path in self.paths.stores().values():
            with read_only(path) as db:
                found.update(r[0] for r in db.execute("SELECT DISTINCT task FROM groups"))
        return sorted(found)

    def groups(self, f: GroupFilter) -> list[GroupRow]:
        """The newest groups matching `f` (at most `f.limit`, never past MAX_ROWS)."""
        limit = max(1, min(f.limit, MAX_ROWS))
        where, args = _where(f)
        out: list[GroupRow] = []
        for model, path in self.paths.stores().items():
            if f.model and model != f.model:
                continue
            with read_only(path) as db:
                if f.search:
                    out += self._search(model, db, where, args, f.search, limit)
                    continue
                rows = db.execute(
                    f"SELECT {_COLUMNS} FROM groups{where} "
                    "ORDER BY received_at DESC, rowid DESC LIMIT ?", (*args, limit),
                ).fetchall()
                out += [_row(model, r) for r in rows]
        out.sort(key=lambda g: g.received_at, reverse=True)
        return out[:limit]

    def _search(
        self, model: str, db: sqlite3.Connection, where: str, args: list[Any], text: str,
        limit: int,
    ) -> list[GroupRow]:
        """Groups a member of whose completions contains `text` (case-insensitive), among
        the newest SEARCH_SCAN groups that still have their payload."""
        where = (where + " AND" if where else " WHERE") + " payload IS NOT NULL"
        cursor = db.execute(
            f"SELECT {_COLUMNS}, payload FROM groups{where} "
            "ORDER BY received_at DESC, rowid DESC LIMIT ?", (*args, SEARCH_SCAN),
        )
        needle = text.lower()
        found: list[GroupRow] = []
        for r in cursor:
            group = group_from_bytes(r[-1])
            if any(needle in c.lower() for c in self.texts(model).completions(group)):
                found.append(_row(model, r[:-1]))
                if len(found) >= limit:
                    break
        return found

    def row(self, model: str, group_id: str) -> GroupRow | None:
        path = self.paths.stores().get(model)
        if path is None:
            return None
        with read_only(path) as db:
            r = db.execute(f"SELECT {_COLUMNS} FROM groups WHERE id = ?", (group_id,)).fetchone()
        return None if r is None else _row(model, r)

    def group(self, model: str, group_id: str) -> OpenedGroup | None:
        """A group with its members decoded (when its payload is still stored)."""
        path = self.paths.stores().get(model)
        if path is None:
            return None
        with read_only(path) as db:
            r = db.execute(
                f"SELECT {_COLUMNS}, payload FROM groups WHERE id = ?", (group_id,)
            ).fetchone()
        if r is None:
            return None
        row = _row(model, r[:-1])
        if r[-1] is None:
            return OpenedGroup(row, None)
        group = group_from_bytes(r[-1])
        rewards = [t.reward for t in group.trajectories]
        name, advantages = self.advantages(model, rewards)
        zero = max(rewards, default=0.0) == min(rewards, default=0.0)
        trained = row.state == "trained" and not zero
        members = [Member(t, a, trained and t.status == "ok")
                   for t, a in zip(group.trajectories, advantages)]
        return OpenedGroup(row, group, members, zero, name)

    # -- the run's recipe, tokenizer and algorithm (best effort, cached) ------------------

    def recipe(self) -> Any | None:
        """The run's recipe (jetctl.recipe.Recipe), or None when its file is gone."""
        if not self._recipe_read:
            from jetctl.recipe import RecipeError, load_recipe

            self._recipe_read = True
            run = read_json(self.paths.run_json) or {}
            try:
                self._recipe = load_recipe(str(run.get("recipe", "")))
            except (RecipeError, OSError):
                self._recipe = None
        return self._recipe

    def advantages(self, model: str, rewards: list[float]) -> tuple[str, list[float]]:
        """(algorithm, advantages) as the model's trainer computes them from the rewards."""
        from jetctl.server import algorithms
        from jetctl.server.algorithms.grpo import group_advantages

        recipe = self.recipe()
        if recipe is None or model not in recipe.models:
            return "grpo (the recipe could not be read)", group_advantages(rewards)
        train = recipe.models[model].train
        return str(train.algorithm), list(algorithms.make(train).advantages(rewards))

    def texts(self, model: str) -> Texts:
        if model not in self._texts:
            recipe = self.recipe()
            source = recipe.models[model].model if recipe and model in recipe.models else None
            self._texts[model] = Texts(source)
        return self._texts[model]

    # -- steps, overview -----------------------------------------------------------------

    def steps(self, model: str) -> list[dict[str, float]]:
        path = self.paths.steps_log(model)
        if not path.is_file():
            return []
        out = []
        for line in path.read_text().splitlines():
            try:
                out.append(json.loads(line))
            except ValueError:
                continue  # a line being written
        return out

    def overview(self, model: str) -> dict[str, Any]:
        """Per task: reward by step, groups by fate, staleness histogram; per model:
        throughput and the share of groups skipped for zero variance (step log)."""
        path = self.paths.stores()[model]
        with read_only(path) as db:
            curve = db.execute(
                "SELECT task, step, SUM(reward_sum) / SUM(n_traj), COUNT(*) FROM groups "
                "WHERE state = 'trained' GROUP BY task, step ORDER BY step"
            ).fetchall()
            fates = db.execute(
                "SELECT task, CASE state WHEN 'rejected' THEN refusal ELSE state END, COUNT(*) "
                "FROM groups GROUP BY 1, 2"
            ).fetchall()
            lags = db.execute(
                "SELECT task, step - min_version, COUNT(*) FROM groups WHERE state = 'trained' "
                "GROUP BY 1, 2 ORDER BY 2"
            ).fetchall()
        tasks: dict[str, dict[str, Any]] = {}
        for task, step, mean, n in curve:
            t = tasks.setdefault(task, {"curve": [], "fates": {}, "staleness": {}})
            t["curve"].append({"step": int(step), "reward": float(mean), "groups": int(n)})
        for task, fate, n in fates:
            tasks.setdefault(task, {"curve": [], "fates": {}, "staleness": {}})["fates"][fate] = n
        for task, lag, n in lags:
            tasks[task]["staleness"][int(lag)] = int(n)
        steps = [s for s in self.steps(model) if "step" in s]
        skipped = sum(s.get("groups/skipped", 0.0) for s in steps)
        used = sum(s.get("groups", 0.0) for s in steps)
        span = steps[-1]["time"] - steps[0]["time"] if len(steps) > 1 else 0.0
        trajs = sum(s.get("trajectories", 0.0) + s.get("trajectories/skipped", 0.0)
                    for s in steps[1:])
        return {
            "model": model, "tasks": tasks, "steps": len(steps),
            "skipped_share": skipped / (skipped + used) if skipped + used else None,
            "trajectories_per_s": trajs / span if span > 0 else None,
            "tokens_per_s": steps[-1].get("tokens_per_second") if steps else None,
            "version": int(steps[-1]["step"]) if steps else 0,
        }

    def step_row(self, model: str, step: int) -> dict[str, float] | None:
        return next((s for s in self.steps(model) if s.get("step") == step), None)

    # -- lineage -------------------------------------------------------------------------

    def checkpoints(self, model: str) -> list[int]:
        """Versions of `model`'s complete local checkpoints (step-N/ with a manifest)."""
        recipe = self.recipe()
        where = recipe.models[model].checkpoint.dir if recipe and model in recipe.models else None
        if where is None:
            folder = self.paths.checkpoints(model)
        elif "://" in where.removeprefix("file://"):
            return []  # a remote store (s3://...): not listed here
        else:
            folder = Path(where.removeprefix("file://"))
        if not folder.is_dir():
            return []
        found = [CHECKPOINT_DIR.match(p.name) for p in folder.iterdir()
                 if (p / "manifest.json").is_file()]
        return sorted(int(m.group(1)) for m in found if m)

    def trace(self, trajectory_id: str) -> Trace:
        """Where one trajectory came from and what became of it."""
        t = Trace(trajectory_id)
        for model, path in self.paths.stores().items():
            with read_only(path) as db:
                r = db.execute(
                    f"SELECT {_COLUMNS} FROM groups WHERE (',' || trajectory_ids || ',') LIKE ? "
                    "LIMIT 1", (f"%,{trajectory_id},%",),
                ).fetchone()
            if r is not None:
                t.model, t.row = model, _row(model, r)
                break
        self._trace_spools(t)
        if t.row is None:
            if not t.status:
                t.notes.append("no store or spool of this run holds this id")
            return t
        row = t.row
        if row.state != "rejected":
            t.verdict = "accepted"
        elif "batch time" in row.reason:  # the trainer's gate (jetctl.server.trainer)
            t.verdict = f"accepted, then refused as {row.refusal} at batch time: {row.reason}"
        else:
            t.verdict = f"refused as {row.refusal} at Submit: {row.reason}"
        t.revision = ",".join(row.revisions)
        opened = self.group(t.model, row.id)
        member = None if opened is None or opened.group is None else next(
            (x for x in opened.group.trajectories if x.id == trajectory_id), None)
        if member is not None:
            t.task_id, t.node = member.task_id, t.node or member.client_id
            t.revision, t.status, t.error = member.client_revision, member.status, member.error
            t.versions = [c.model_version for c in member.calls]
        else:
            t.notes.append(
                "its group's payload is no longer stored (dropped once a checkpoint holds "
                f"its step, or at refusal): task row and versions per turn are gone; the "
                f"oldest call's version was {row.min_version}")
        if row.state == "trained":
            t.step = row.step
            if opened is not None and opened.zero_variance:
                t.notes.append(f"its group had no reward variance: consumed at version "
                               f"{row.step} without a gradient step")
            held = [v for v in self.checkpoints(t.model) if row.step is not None and v >= row.step]
            t.checkpoint = f"step-{held[0]:08d}" if held else ""
            if not held:
                t.notes.append("no checkpoint on disk holds its step yet (or it was pruned)")
        return t

    def _trace_spools(self, t: Trace) -> None:
        """The node that made it (the spool naming its group or its id) and, for a dropped
        one, the reason and error."""
        gid = t.row.id if t.row is not None else None
        for node, path in self.paths.spools().items():
            try:
                with read_only(path) as db:
                    d = db.execute("SELECT reason, error FROM dropped WHERE trajectory_id = ?",
                                   (t.trajectory_id,)).fetchone()
                    o = None if gid is None else db.execute(
                        "SELECT outcome, reason FROM outcomes WHERE group_id = ?", (gid,)
                    ).fetchone()
            except sqlite3.Error as e:
                t.notes.append(f"spool of {node} unreadable: {e}")
                continue
            if d is not None:
                t.node, t.status, t.error = node, f"dropped ({d[0]})", d[1]
                t.verdict = "never submitted: the client dropped it"
            if o is not None:
                t.node = node


class Texts:
    """Token ids to text with the model's tokenizer (None when it cannot be loaded: pages
    then show ids)."""

    def __init__(self, source: str | None) -> None:
        self.source = source
        self._tok: Any | None = None
        self.problem = "" if source else "the run's recipe (and so its model) could not be read"

    def tokenizer(self) -> Any | None:
        if self._tok is None and self.source and not self.problem:
            from jetctl.models import load_tokenizer

            try:
                self._tok = load_tokenizer(self.source, progress=False)
            except (OSError, ValueError) as e:
                self.problem = f"tokenizer of {self.source}: {e}"
        return self._tok

    def pieces(self, ids: list[int]) -> list[str]:
        tok = self.tokenizer()
        return [str(i) for i in ids] if tok is None else [tok.decode([i]) for i in ids]

    def text(self, ids: list[int]) -> str:
        tok = self.tokenizer()
        return " ".join(map(str, ids)) if tok is None else str(tok.decode(ids))

    def completions(self, group: TrajectoryGroup) -> list[str]:
        return [self.text(c.completion_ids) for t in group.trajectories for c in t.calls]
