"""The live view of a run: ask its controller (`Control.Status`) and show servers and clients.

`fetch_status(run_dir)` calls the controller found through run.json; `document(reply)` turns
the reply into the JSON document `jetctl status --once --json` prints; `render_status(doc)`
and `render_progress(doc, recipe)` draw it with rich (the second is the `jetctl up` view).
A dead controller is a `RunDirError` with one line that says what to do.
"""

from __future__ import annotations

import json
import time
from pathlib import Path
from typing import Any

import grpc
from rich import box
from rich.console import Group, RenderableType
from rich.progress_bar import ProgressBar
from rich.table import Table
from rich.text import Text

from jetctl.link import call_control
from jetctl.proctree import pid_alive
from jetctl.proto._gen import control_pb2 as cpb
from jetctl.recipe import Recipe
from jetctl.rundir import (
    RunDirError,
    RunPaths,
    RunRecord,
    TrainedRecord,
    read_run_record,
    read_token_for,
)
from jetctl.tls import TlsFiles


class RunFinished(RunDirError):
    """The run ended normally; its controller has exited."""


def controller_alive(info: RunRecord | None) -> bool:
    """The run's controller process runs (its pid, and its start time: a recycled pid is not
    it). `info`: run.json as `read_run_record` reads it (None, from `peek_run_record`: no
    run.json yet, so no controller)."""
    ctl = info.controller if info is not None else None
    return ctl is not None and pid_alive(ctl.pid, ctl.create_time)


def fetch_status(run_dir: Path, timeout_s: float = 5.0) -> cpb.RunStatusReply:
    """The controller's `Status` reply; RunDirError when the controller is gone or silent."""
    info = read_run_record(run_dir)
    ctl = info.controller
    if ctl is None or not controller_alive(info):
        if info.state == "finished":
            raise RunFinished(f"run {info.run} has finished; its reward curve is in "
                              f"{RunPaths(run_dir).reward_curve_png}")
        raise RunDirError(
            f"the controller of run {info.run} (pid {ctl.pid if ctl else None}) is not running: "
            f"`jetctl up {info.recipe} --resume` adopts its nodes again, "
            f"`jetctl down --run-dir {run_dir}` stops them"
        )
    token = read_token_for(run_dir)
    try:
        reply: cpb.RunStatusReply = call_control(
            ctl.endpoint, token, "Status", cpb.RunStatusRequest(), timeout_s,
            tls=TlsFiles.from_json(info.tls),
        )
    except grpc.RpcError as e:
        raise RunDirError(
            f"the controller of run {info.run} at {ctl.endpoint} did not answer: "
            f"{e.code().name}: {e.details()}"
        ) from None
    return reply


# -- a finished run ------------------------------------------------------------------------

FINAL_REWARD_BATCHES = 10  # the final reward is the mean of the last this many batches


def finished_summary(run_dir: Path) -> dict[str, Any]:
    """The document of a run whose controller has exited, from the files it left: per model
    the steps trained, the final reward and the last checkpoint; the ledger; the curve.
    `jetctl status` shows it for a finished run and `jetctl up` ends with it."""
    from jetctl.controller.plot import read_run_rewards
    from jetctl.costs import read_costs, read_node_waste
    from jetctl.run.ledger import build_ledger

    info = read_run_record(run_dir)
    paths = RunPaths(run_dir)
    dirs = _checkpoint_dirs(info.recipe)
    rewards = read_run_rewards(run_dir)
    models: dict[str, Any] = {}
    for model in sorted(set(info.trained) | set(rewards)):
        points = rewards.get(model) or []
        # what the controller heard from the server over the network (jetctl.controller.
        # state.trained): right wherever the server ran; its step log is on its own host
        heard = info.trained.get(model) or TrainedRecord()
        last = [p.reward for p in points[-FINAL_REWARD_BATCHES:]]
        where = dirs.get(model) or str(paths.checkpoints(model))
        checkpoint = _last_checkpoint(where)
        if checkpoint is None and heard.last_checkpoint_version:
            checkpoint = f"step {heard.last_checkpoint_version}, on the server's host"
        if last:
            final_reward, source = sum(last) / len(last), "steps log"
        elif heard.reward_mean_recent is not None and heard.trained_groups:
            final_reward, source = heard.reward_mean_recent, "server status"
        else:
            final_reward, source = None, None
        models[model] = {
            # the version: optimizer steps
            "steps": heard.version if heard.version is not None
            else (points[-1].step if points else 0),
            "batches": len(points),
            "final_reward": final_reward,
            "final_reward_batches": len(last),
            # steps log: the mean of the last batches; server status: its recent trajectories
            "final_reward_source": source,
            "checkpoint_dir": where,
            "last_checkpoint": checkpoint,
        }
        costs = read_costs(paths.steps_log(model))  # jetctl.costs: None without cost figures
        if costs is not None:
            models[model]["costs"] = costs.to_json()
    started, finished = info.started_at, info.finished_at
    return {
        "run": info.run,
        "run_dir": str(run_dir),
        "state": info.state,
        "stop_reason": info.stop_reason,
        "started_at": started,
        "finished_at": finished,
        "duration_s": round(finished - started, 3) if started and finished else None,
        "models": models,
        "reward_curve": str(paths.reward_curve_png) if paths.reward_curve_png.is_file() else None,
        "reward_curve_csv": (
            str(paths.reward_curve_csv) if paths.reward_curve_csv.is_file() else None
        ),
        "ledger": build_ledger(run_dir).summary(),
        "evals": _evals(run_dir),  # per task, its newest eval's figures
        # per task: what its nodes' dropped trajectories cost (jetctl.costs, their last syncs)
        "waste": read_node_waste(paths.nodes),
    }


def _checkpoint_dirs(recipe_path: str) -> dict[str, str]:
    """model -> its recipe's checkpoint.dir (folder or URL), where the recipe still loads."""
    from jetctl.recipe import RecipeError, load_recipe

    try:
        recipe = load_recipe(recipe_path)
    except RecipeError:
        return {}
    return {m: c.checkpoint.dir for m, c in recipe.models.items() if c.checkpoint.dir}


def _last_checkpoint(where: str) -> str | None:
    """The newest `step-N` with a manifest (jetctl.server.checkpoint writes it last)."""
    import fsspec

    try:
        fs, root = fsspec.core.url_to_fs(where)
        names = sorted(p.rstrip("/").rsplit("/", 1)[-1] for p in fs.ls(root, detail=False))
    except (OSError, ValueError, ImportError):
        return None
    for name in reversed(names):
        if name.startswith("step-") and not name.endswith(".partial") and fs.exists(
            f"{root.rstrip('/')}/{name}/manifest.json"
        ):
            return where.rstrip("/") + "/" + name
    return None


def render_summary(summary: dict[str, Any]) -> RenderableType:
    """A finished run in a few lines: why it ended, per model its steps, final reward and
    last checkpoint, the ledger, and where the reward curve is."""
    head = Text()
    head.append(f"run {summary['run']}", style="bold")
    head.append("  ")
    head.append(summary["state"], style=_STATE_STYLE.get(summary["state"], "cyan"))
    if summary.get("stop_reason"):
        head.append(f" ({summary['stop_reason']})")
    if summary.get("duration_s") is not None:
        head.append(f"  ran {_duration(summary['duration_s'])}", style="dim")
    head.append(f"  {summary['run_dir']}", style="dim")
    caption = f"steps = optimizer steps; final reward: mean of the last {FINAL_REWARD_BATCHES} batches"
    from_status = [m for m, v in summary["models"].items()
                   if v.get("final_reward_source") == "server status"]
    if from_status:  # a server on another host: its step log stayed there
        caption += (f" ({', '.join(from_status)}: of its server's recent trajectories, "
                    "its step log is on its host)")
    t = Table(title="models", title_justify="left", caption=caption, caption_justify="left",
              box=box.SIMPLE_HEAD, padding=(0, 1), show_edge=False, pad_edge=False)
    for col in ("model", "steps", "final reward", "last checkpoint"):
        t.add_column(col, justify="right" if col in ("steps", "final reward") else "left")
    for model, m in summary["models"].items():
        t.add_row(model, str(m["steps"]), _fmt(m["final_reward"], 3),
                  m["last_checkpoint"] or f"none in {m['checkpoint_dir']}")
    parts: list[RenderableType] = [head, Text(""), t, Text(""), ledger_line(summary["ledger"])]
    from jetctl.costs import cost_line, waste_line

    parts += [Text(cost_line(model, m["costs"])) for model, m in summary["models"].items()
              if m.get("costs")]
    parts += [Text(waste_line(task, w)) for task, w in (summary.get("waste") or {}).items()]
    parts += eval_lines(summary.get("evals") or {})
    curve = summary.get("reward_curve")
    parts.append(Text(f"reward curve: {curve} (and {summary['reward_curve_csv']})" if curve
                      else "reward curve: none (no batch was trained)"))
    return Group(*parts)


# -- the JSON document ---------------------------------------------------------------------


def _figures(raw: str) -> dict[str, Any]:
    try:
        data = json.loads(raw) if raw else {}
    except ValueError:
        return {}
    return data if isinstance(data, dict) else {}


def _int(figures: dict[str, Any], key: str) -> int | None:
    # int64 fields arrive as JSON strings (proto3 JSON mapping)
    return int(figures[key]) if key in figures else None


def _float(figures: dict[str, Any], key: str) -> float | None:
    return float(figures[key]) if key in figures else None


def server_entry(node: cpb.NodeStatus) -> dict[str, Any]:
    f = _figures(node.json)
    return {
        "name": node.name,
        "model": node.model,
        "state": node.state,
        "pid": node.pid or None,
        "restarts": node.restarts,
        "endpoint": node.endpoint,
        "version": _int(f, "model_version"),
        "buffer_depth": _int(f, "buffer_groups"),
        "accepted": _int(f, "accepted_trajectories"),
        "accepted_groups": _int(f, "accepted_groups"),
        "rejected": {k: int(v) for k, v in (f.get("rejected") or {}).items()},
        "rejected_groups": {k: int(v) for k, v in (f.get("rejected_groups") or {}).items()},
        "trained": _int(f, "trained_trajectories"),
        "trained_groups": _int(f, "trained_groups"),
        # accepted = trained + still buffered, all in trajectories (the store's own counts)
        "buffered": _difference(_int(f, "accepted_trajectories"), _int(f, "trained_trajectories")),
        "reward_mean": _float(f, "reward_mean_recent"),
        "trajectories_per_second": _float(f, "trajectories_per_second"),
        "tokens_generated": _int(f, "tokens_generated"),
        "last_checkpoint_version": _int(f, "last_checkpoint_version"),
        "last_step": f.get("last_step") or {},
        "received_by_task": {k: int(v) for k, v in (f.get("received_by_task") or {}).items()},
        "reward_by_task": {k: float(v) for k, v in (f.get("reward_by_task") or {}).items()},
        # train.mix: each mixed task's share of the recent batches, and the starving ones
        "batch_share_by_task": {
            k: float(v) for k, v in (f.get("batch_share_by_task") or {}).items()
        },
        "starving_tasks": list(f.get("starving_tasks") or []),
        # mean lag (versions behind at the step) of each task's last 32 trained groups
        "staleness_by_task": {k: float(v) for k, v in (f.get("staleness_by_task") or {}).items()},
        # while it starts: what the server process is doing (server-<model>/phase.json)
        "phase": f.get("phase") if node.state == "starting" else None,
        "phase_since": f.get("phase_since") if node.state == "starting" else None,
        "skipped_groups": _int(f, "skipped_groups"),
        "no_signal_recent": _float(f, "no_signal_recent"),
        "signal": f.get("signal") or "ok",
        # per task: its last 64 consumed groups' share without signal, and the verdict
        "no_signal_by_task": {k: float(v) for k, v in (f.get("no_signal_by_task") or {}).items()},
        "signal_by_task": dict(f.get("signal_by_task") or {}),
    }


def _difference(a: int | None, b: int | None) -> int | None:
    return None if a is None or b is None else a - b


def client_entry(node: cpb.NodeStatus) -> dict[str, Any]:
    f = _figures(node.json)
    # the node's own state (draining, backoff, ...) says more while its process runs
    own_state = f.get("state")
    state = own_state if node.state == "running" and own_state else node.state
    return {
        "name": node.name,
        "task": node.task,
        "model": node.model,
        "models": f.get("models") or [node.model],
        "roles": f.get("roles") or {},  # a team task's role -> model
        "state": state,
        "process_state": node.state,
        # the runtime's pid; else (a Ray actor, a node that joined) the one it reports
        "pid": node.pid or f.get("pid") or None,
        "container_id": node.container_id or None,
        "restarts": node.restarts,
        "revision": node.revision,
        "rollouts_done": f.get("rollouts_done"),
        "rollouts_failed": f.get("rollouts_failed"),
        "rollouts_timeout": f.get("rollouts_timeout"),
        "groups_spooled": f.get("groups_spooled"),
        "spool_depth": f.get("spool_depth"),
        "concurrency": f.get("concurrency"),  # rollouts it may run at once
        "concurrency_why": f.get("concurrency_why"),  # auto: the governor's last reason
        "server_reachable": f.get("server_reachable"),
        "acks": f.get("acks") or {},
        "dropped": f.get("dropped") or {},
        "tokens_generated": {k: int(v) for k, v in (f.get("tokens_generated") or {}).items()},
        # what its dropped trajectories cost (jetctl.costs.add_waste)
        "waste": {k: float(v) for k, v in (f.get("waste") or {}).items()},
        "updated_at": f.get("updated_at"),
        "address": f.get("address"),  # where it runs, as the controller sees it
    }


def document(reply: cpb.RunStatusReply) -> dict[str, Any]:
    """The `jetctl status --once --json` document."""
    doc: dict[str, Any] = {
        "run": reply.run,
        "run_dir": reply.run_dir,
        "state": reply.state,
        "uptime_s": round(reply.uptime_s, 3),
        "servers": [server_entry(n) for n in reply.nodes if n.kind == "server"],
        "clients": [client_entry(n) for n in reply.nodes if n.kind == "client"],
    }
    tasks = task_summary(doc)
    for task, progress in reply.rows_json.items():  # dataset tasks (jetctl.controller.rows)
        tasks.setdefault(task, {})["rows"] = json.loads(progress)
    if reply.run_dir:  # the newest eval of each task evaluated (RUN_DIR/eval/, jetctl.run.eval)
        for task, figures in _evals(Path(reply.run_dir)).items():
            tasks.setdefault(task, {})["eval"] = figures
    doc["tasks"] = tasks
    if reply.run_dir:  # each local server's cost ledger so far (its step log, jetctl.costs)
        models = [n.model for n in reply.nodes if n.kind == "server"]
        costs = live_costs(Path(reply.run_dir), models)
        if costs:
            doc["costs"] = costs
    from jetctl.costs import client_waste

    waste = client_waste(doc["clients"])  # per task, its nodes' dropped trajectories' costs
    if waste:
        doc["waste"] = waste
    return doc


def live_costs(run_dir: Path, models: list[str]) -> dict[str, dict[str, Any]]:
    """model -> `Costs.to_json()` of its step log so far; a model whose server runs on
    another host (its step log stays there) or has no step yet is left out."""
    from jetctl.costs import read_costs

    out: dict[str, dict[str, Any]] = {}
    for model in sorted(set(models)):
        costs = read_costs(RunPaths(run_dir).steps_log(model))
        if costs is not None:
            out[model] = costs.to_json()
    return out


def task_summary(doc: dict[str, Any]) -> dict[str, dict[str, Any]]:
    """Per task: the models that train on it (and a team's roles, as its nodes report them),
    its nodes' revisions, nodes up, rollouts, spool, the trajectories the servers received
    from it (`received_by_task`, summed over the servers) and the mean reward of its last 32
    accepted groups on each server training it (`reward_by_model`; `reward`: their mean, the
    one server's for a task of one model); the mean lag of its last 32 groups trained in a
    step on each server (`staleness_by_model`; `staleness`: the largest, in versions); with
    `train.mix`, its share of the recent batches (`batch_share`) and whether the batches wait
    for it or back-fill its slots (`starving`)."""
    tasks: dict[str, dict[str, Any]] = {}

    def entry(task: str) -> dict[str, Any]:
        return tasks.setdefault(task, {"models": [], "roles": {}, "revisions": [], "nodes": 0,
                                       "up": 0, "rollouts_done": 0, "spool_depth": 0,
                                       "received": 0, "reward": None, "reward_by_model": {},
                                       "staleness": None, "staleness_by_model": {},
                                       "batch_share": None, "starving": False})

    for c in doc["clients"]:
        e = entry(c["task"])
        e["roles"].update(c.get("roles") or {})
        for model in c.get("models") or [c["model"]]:
            if model and model not in e["models"]:
                e["models"].append(model)
        if c["revision"] not in e["revisions"]:
            e["revisions"].append(c["revision"])
        e["nodes"] += 1
        e["up"] += int(c["process_state"] == "running")
        e["rollouts_done"] += int(c["rollouts_done"] or 0)
        e["spool_depth"] += int(c["spool_depth"] or 0)
    for srv in doc["servers"]:
        for task, n in (srv.get("received_by_task") or {}).items():
            entry(task)["received"] += int(n)
        for task, reward in (srv.get("reward_by_task") or {}).items():
            e = entry(task)
            e["reward_by_model"][srv["model"]] = float(reward)
            if srv["model"] not in e["models"]:
                e["models"].append(srv["model"])
        for task, lag in (srv.get("staleness_by_task") or {}).items():
            entry(task)["staleness_by_model"][srv["model"]] = float(lag)
        for task, share in (srv.get("batch_share_by_task") or {}).items():
            entry(task)["batch_share"] = float(share)
        for task in srv.get("starving_tasks") or []:
            entry(task)["starving"] = True
    for e in tasks.values():
        rewards = list(e["reward_by_model"].values())
        e["reward"] = sum(rewards) / len(rewards) if rewards else None
        lags = list(e["staleness_by_model"].values())
        e["staleness"] = max(lags) if lags else None
    return dict(sorted(tasks.items()))


def trains_on(entry: dict[str, Any]) -> str:
    """A task's models as the tasks table shows them: `model`, or a team's `role:model`s."""
    return models_of(entry.get("roles") or {}, entry.get("models") or [])


def batch_share(entry: dict[str, Any]) -> str:
    """A mixed task's share of the recent batches, and `starving` when it falls short."""
    share = entry.get("batch_share")
    if share is None:
        return "-"
    return f"{share:.2f}" + (" starving" if entry.get("starving") else "")


def task_reward(entry: dict[str, Any]) -> str:
    """A task's recent reward: one number, or a team's per role (`role reward`)."""
    return _per_role(entry, entry.get("reward_by_model") or {}, "{:.3f}")


def dataset_rows(entry: dict[str, Any]) -> str:
    """A dataset task's `epoch N: position/rows` (`-` for other tasks)."""
    rows = entry.get("rows")
    if not rows:
        return "-"
    return f"epoch {rows['epoch']}: {rows['position']}/{rows['rows']}"


def task_staleness(entry: dict[str, Any]) -> str:
    """A task's recent staleness in versions: one number, or a team's per role."""
    return _per_role(entry, entry.get("staleness_by_model") or {}, "{:.1f}")


def _per_role(entry: dict[str, Any], by_model: dict[str, float], fmt: str) -> str:
    """One model's figure, or a team's `role figure` pairs (a model named by its role)."""
    if not by_model:
        return "-"
    if len(by_model) == 1:
        return fmt.format(next(iter(by_model.values())))
    role_of = {m: r for r, m in (entry.get("roles") or {}).items()}
    return " ".join(f"{role_of.get(m, m)} {fmt.format(v)}" for m, v in by_model.items())


# -- rendering -----------------------------------------------------------------------------


def models_of(roles: dict[str, str], models: list[str]) -> str:
    """What trains on a task: its model, or a team's `role:model` pairs."""
    if roles:
        return ", ".join(f"{r}:{m}" for r, m in roles.items())
    return ", ".join(models) or "-"


def _fmt(v: Any, digits: int = 0) -> str:
    if v is None:
        return "-"
    if isinstance(v, float):
        return f"{v:.{digits}f}" if digits else f"{v:.3g}"
    return str(v)


def _duration(s: float) -> str:
    s = int(s)
    h, rem = divmod(s, 3600)
    m, sec = divmod(rem, 60)
    return f"{h}h{m:02d}m{sec:02d}s" if h else f"{m}m{sec:02d}s"


_STATE_STYLE = {
    "running": "green",
    "starting": "yellow",
    "pending": "yellow",
    "restarting": "red",
    "backoff": "red",
    "draining": "magenta",
    "exited": "dim",
}


def _state(s: str) -> Text:
    return Text(s, style=_STATE_STYLE.get(s, ""))


def header(doc: dict[str, Any]) -> Text:
    t = Text()
    t.append(f"run {doc['run']}", style="bold")
    t.append("  ")
    t.append(doc["state"], style=_STATE_STYLE.get(doc["state"], "cyan"))
    t.append(f"  up {_duration(doc['uptime_s'])}  {doc['run_dir']}", style="dim")
    return t


def clients_table(doc: dict[str, Any]) -> Table:
    t = Table(title="clients", title_justify="left",
              caption="rollouts: trajectories; spooled: groups waiting for their ack; slots: "
              "rollouts at once, and why (concurrency: auto)",
              caption_justify="left", box=box.SIMPLE_HEAD, padding=(0, 1), show_edge=False,
              pad_edge=False)
    for col in ("node", "task", "state", "rev", "rollouts", "spooled", "slots", "server",
                "restarts"):
        t.add_column(col, justify="right" if col in ("rollouts", "spooled", "restarts") else "left",
                     no_wrap=col in ("node", "state"))
    for c in doc["clients"]:
        reach = c["server_reachable"]
        server = Text("-") if reach is None else (
            Text("ok", style="green") if reach else Text("unreachable", style="red")
        )
        t.add_row(
            c["name"], c["task"], _state(c["state"]), c["revision"], _fmt(c["rollouts_done"]),
            _fmt(c["spool_depth"]), _slots(c), server, str(c["restarts"]),
        )
    return t


def _slots(c: dict[str, Any]) -> str:
    """`16 trainer waits for groups`: the limit and the head of its reason."""
    if c.get("concurrency") is None:
        return "-"
    why = str(c.get("concurrency_why") or "").split(" (")[0].split(";")[0]
    return f"{c['concurrency']} {why}".strip()


def ledger_line(ledger: dict[str, Any]) -> Text:
    """Totals of `jetctl.run.ledger` in one line: the verdict first (a narrow terminal wraps the
    counts, not the word that matters), then where every trajectory id is (rejected,
    dropped and in flight when not 0)."""
    t = Text("ledger  ", style="bold")
    if ledger["balanced"]:
        t.append("balanced", style="green")
    else:
        t.append(f"NOT balanced: lost {ledger['lost']}, trained twice {ledger['trained_twice']}, "
                 f"conflicts {ledger['conflicts']}", style="red")
    counts = [("produced", ledger["produced"]), ("trained", ledger["trained"])] + [
        (name, n) for name, n in (
            ("rejected", sum(ledger["rejected"].values())),
            ("dropped", sum(ledger["dropped"].values())),
            ("in flight", sum(ledger["in_flight"].values())),
        ) if n  # the rest only when not 0
    ]
    t.append(": " + ", ".join(f"{name} {n}" for name, n in counts))
    return t


MODELS_CAPTION = "version = optimizer steps; accepted, trained, buffered, rejected: trajectories"
TASKS_CAPTION = ("rollouts, failed and received: trajectories; staleness: versions behind, "
                 "mean of the last 32 trained groups; rows: a dataset task's epoch and its "
                 "position in it")


def _server_state(s: dict[str, Any]) -> Text:
    """The state, and while a server starts, what it is doing and for how long."""
    text = _state(s["state"])
    if s.get("phase"):
        since = s.get("phase_since")
        took = f" {_duration(max(0.0, time.time() - float(since)))}" if since else ""
        text.append(f": {s['phase']}{took}", style="dim")
    return text


def models_table(doc: dict[str, Any], recipe: Recipe | None = None) -> Table:
    """One row per model (= server), the same columns in `jetctl up` and `jetctl status`;
    with a recipe, the version shows its progress toward train.max_steps."""
    t = Table(title="models", title_justify="left", caption=MODELS_CAPTION,
              caption_justify="left", box=box.SIMPLE_HEAD, padding=(0, 1), show_edge=False,
              pad_edge=False)
    for col in ("model", "state", "version", "reward", "traj/s", "accepted", "trained",
                "buffered", "rejected", "restarts"):
        t.add_column(col, justify="left" if col in ("model", "state", "rejected") else "right",
                     no_wrap=col == "model")
    for s in doc["servers"]:
        version = _fmt(s["version"])
        max_steps = None
        if recipe is not None and s["model"] in recipe.models:
            max_steps = recipe.models[s["model"]].train.max_steps
        if max_steps:
            version += f"/{max_steps}"
        rejected = ", ".join(f"{k} {v}" for k, v in sorted(s["rejected"].items())) or "-"
        t.add_row(
            s["model"], _server_state(s), version, _fmt(s["reward_mean"], 3),
            _fmt(s["trajectories_per_second"], 2), _fmt(s["accepted"]), _fmt(s["trained"]),
            _fmt(s.get("buffered")), rejected, str(s["restarts"]),
        )
    return t


def tasks_table(doc: dict[str, Any], recipe: Recipe | None = None) -> Table:
    """One row per task: its nodes up, the trajectories they produced and the servers
    received, and its recent reward; the same columns in `jetctl up` and `jetctl status`."""
    t = Table(title="tasks", title_justify="left", caption=TASKS_CAPTION, caption_justify="left",
              box=box.SIMPLE_HEAD, padding=(0, 1), show_edge=False, pad_edge=False)
    for col in ("task", "model", "rev", "clients up", "rollouts", "failed", "received",
                "reward", "staleness", "batch share", "rows", "restarts"):
        t.add_column(col, justify="left" if col in ("task", "model", "rev") else "right",
                     no_wrap=col != "model")
    summary = doc.get("tasks") or task_summary(doc)
    names = list(recipe.tasks) if recipe is not None else list(summary)
    for task in names:
        e = summary.get(task) or {}
        nodes = [c for c in doc["clients"] if c["task"] == task]
        wanted = recipe.tasks[task].clients if recipe is not None else len(nodes)
        if recipe is not None:  # a team's roles even before its nodes report them
            e = {**e, "roles": recipe.tasks[task].roles, "models": recipe.tasks[task].models}
        failed = sum(int(c["rollouts_failed"] or 0) + int(c["rollouts_timeout"] or 0)
                     for c in nodes)
        t.add_row(
            task, trains_on(e), ",".join(e.get("revisions") or []) or "-",
            f"{sum(1 for c in nodes if c['process_state'] == 'running')}/{wanted}",
            _fmt(e.get("rollouts_done", 0)), str(failed), _fmt(e.get("received", 0)),
            task_reward(e), task_staleness(e), batch_share(e), dataset_rows(e),
            str(sum(c["restarts"] for c in nodes)),
        )
    return t


def render_status(doc: dict[str, Any]) -> RenderableType:
    """The `jetctl status` view: a header, the models, tasks and clients tables (and the
    ledger's totals when the document has them)."""
    parts: list[RenderableType] = [
        header(doc), Text(""), models_table(doc), Text(""), tasks_table(doc), Text(""),
        clients_table(doc),
    ]
    parts += eval_lines(task_evals(doc))
    parts += signal_lines(doc)
    from jetctl.costs import cost_line, waste_line

    parts += [Text(cost_line(model, c)) for model, c in (doc.get("costs") or {}).items()]
    parts += [Text(waste_line(task, w)) for task, w in (doc.get("waste") or {}).items()]
    if doc.get("ledger"):
        parts += [Text(""), ledger_line(doc["ledger"])]
    return Group(*parts)


def _evals(run_dir: Path) -> dict[str, dict[str, Any]]:
    """Each task's newest eval figures; jetctl.run.eval imported only here (it pulls the env
    and rollout modules in, which the rest of the status view does without)."""
    from jetctl.run.eval import latest_results

    return latest_results(run_dir)


def task_evals(doc: dict[str, Any]) -> dict[str, dict[str, Any]]:
    """task -> its newest eval's figures, for the tasks of the document that have one."""
    return {t: e["eval"] for t, e in (doc.get("tasks") or {}).items() if e.get("eval")}


def eval_lines(evals: dict[str, dict[str, Any]]) -> list[RenderableType]:
    """A line per task evaluated (an in-run `eval:` or `jetctl eval`): the newest step's
    pass@1 and mean reward, on which split, over how many rows and samples."""
    lines: list[RenderableType] = []
    for task, f in evals.items():
        lines.append(Text(
            f"eval {task}: step {f.get('step')} ({f.get('split')}, {f.get('rows')} rows x "
            f"{f.get('samples')}): pass@1 {_fmt(f.get('pass_at_1'), 3)}, mean reward "
            f"{_fmt(f.get('mean_reward'), 3)}"))
    return lines


def signal_lines(doc: dict[str, Any]) -> list[RenderableType]:
    """A warning per task whose recent groups carry no GRPO signal (all rewards equal), named
    `model` when the server trains one task and `model/task` when it trains several."""
    lines: list[RenderableType] = []
    for s in doc["servers"]:
        verdicts = s.get("signal_by_task") or {}
        shares = s.get("no_signal_by_task") or {}
        if not verdicts and s.get("signal") in ("collapsed", "solved"):  # an older server
            verdicts, shares = {"": s["signal"]}, {"": s.get("no_signal_recent") or 0.0}
        for task, verdict in sorted(verdicts.items()):
            who = s["model"] if len(verdicts) == 1 or not task else f"{s['model']}/{task}"
            share = shares.get(task, 0.0)
            if verdict == "collapsed":
                lines.append(Text(
                    f"{who}: no learning signal: {share:.0%} of the last 64 groups scored the "
                    "same in every rollout, mostly below the best reward seen (collapsed to one "
                    "answer); it will not recover by itself: lower the learning rate or raise "
                    "the sampling temperature", style="bold red"))
            elif verdict == "solved":
                lines.append(Text(
                    f"{who}: {share:.0%} of the last 64 groups scored the best reward in every "
                    "rollout (solved): nothing left to learn from this task", style="yellow"))
    return lines


def render_progress(doc: dict[str, Any], recipe: Recipe) -> RenderableType:
    """The `jetctl up` view: the header, a bar toward run.duration_s, and the models and
    tasks tables of `jetctl status` (versions against train.max_steps)."""
    parts: list[RenderableType] = [header(doc)]
    duration = recipe.run.duration_s
    if duration:
        bar = Table.grid(padding=(0, 1))
        bar.add_row(
            Text("time   ", style="dim"),
            ProgressBar(total=duration, completed=min(doc["uptime_s"], duration), width=30),
            Text(f"{_duration(doc['uptime_s'])} / {_duration(duration)}", style="dim"),
        )
        parts.append(bar)
    parts += [Text(""), models_table(doc, recipe), Text(""), tasks_table(doc, recipe)]
    parts += eval_lines(task_evals(doc))
    parts += signal_lines(doc)
    return Group(*parts)
