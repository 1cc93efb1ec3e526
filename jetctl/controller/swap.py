"""Rolling swap of a task's client nodes to a new revision while training goes on.

`Swapper.swap_clients` (`jetctl swap-clients`, `Control.SwapClients`) starts the task's new
revision beside the old one (nodes `<task>-<index>-<rev>`, `--revision rev --name ...`, a new
agent or image; the reconcile loop starts them), waits until each new node syncs `running`,
then (with `drop_old`) tells the servers to refuse the old revision (in their sync replies;
each echoes what it enforces) and drains the old nodes like `down` does (nodes that joined
by hand are told to drain at their next sync); under `runtime: ray` the drained revision's
placement group is removed, so its resources are there for the next swap. New nodes that do
not come up (or keep crashing) are removed and the old revision keeps running. The task's
current revision is kept in run.json (RunState.revisions) so that a resumed controller keeps
it.
"""

from __future__ import annotations

import logging
import re
import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass

from jetctl.controller.reconcile import Reconciler
from jetctl.controller.state import Node, RunState, TaskRevision, server_node_name

log = logging.getLogger("jetctl.controller")

_ENTRY_POINT = re.compile(r"^[A-Za-z_]\w*(\.[A-Za-z_]\w*)*:[A-Za-z_]\w*$")


@dataclass(frozen=True)
class SwapResult:
    ok: bool
    message: str
    revision: str = ""


class Swapper:
    """Swaps, one at a time per task; the reconcile loop starts and restarts the nodes."""

    def __init__(
        self, state: RunState, reconciler: Reconciler, stopping: threading.Event,
        grace_s: float,
    ) -> None:
        self.state = state
        self.reconciler = reconciler
        self.paths = state.paths
        self.recipe = state.recipe
        self.grace_s = grace_s  # the drain time of the old nodes when the caller gives none
        self._stopping = stopping
        self.swapping: set[str] = set()  # tasks with a swap in progress

    def swap_clients(
        self,
        task: str,
        *,
        image: str | None = None,
        agent: str | None = None,
        grace_s: float | None = None,
        drop_old: bool = False,
        healthy_timeout_s: float = 180.0,
    ) -> SwapResult:
        """Replace `task`'s client nodes by a new revision without pausing training.

        Start the new revision's nodes beside the old ones; once every new node syncs
        `running` (it registered with its server), refuse the old
        revision at the servers (`drop_old`) and drain the old nodes (SIGTERM: they finish
        or time out their rollouts and flush their spools, up to `grace_s`, then SIGKILL).
        If the new nodes do not come up within `healthy_timeout_s` (or keep crashing), they
        are removed and the old revision keeps running. Blocks until done."""
        problem = self._problem(task, image, agent)
        if problem:
            return SwapResult(False, problem)
        with self.state.lock:
            if task in self.swapping:
                return SwapResult(False, f"a swap of task {task!r} is already in progress")
            self.swapping.add(task)
        try:
            grace = self.grace_s if grace_s is None or grace_s <= 0 else grace_s
            return self._swap(task, image, agent, grace, drop_old, healthy_timeout_s)
        finally:
            with self.state.lock:
                self.swapping.discard(task)

    def _problem(self, task: str, image: str | None, agent: str | None) -> str:
        if task not in self.recipe.tasks:
            known = ", ".join(sorted(self.recipe.tasks)) or "none"
            return f"task {task!r} is not in the recipe (tasks: {known})"
        phase = self.state.phase
        if phase != "running" or self._stopping.is_set():
            return f"the run is {phase if not self._stopping.is_set() else 'stopping'}: no swap"
        if not image and not agent:
            return "pass --image IMAGE (runtime: docker) or --agent module:function"
        if agent and not _ENTRY_POINT.match(agent):
            return f"--agent {agent!r} must be module:function, e.g. agents.web:agent"
        runtime = self.recipe.tasks[task].runtime
        if image:
            if runtime != "docker":
                return (
                    f"--image needs runtime: docker, and task {task!r} runs as {runtime}: "
                    "pass --agent instead"
                )
            check = getattr(self.reconciler.runtimes.get("docker"), "check_image", None)
            if check is not None:
                from jetctl.controller.runtimes.docker import RuntimeUnavailable

                try:
                    check(image)
                except RuntimeUnavailable as e:
                    return str(e)
        return ""

    def _swap(
        self, task: str, image: str | None, agent: str | None, grace_s: float, drop_old: bool,
        healthy_timeout_s: float,
    ) -> SwapResult:
        state = self.state
        with state.lock:
            old_rev = state.revisions[task]
            new_rev = TaskRevision(
                revision=state.next_revision(),
                agent=agent or old_rev.agent,
                image=image or old_rev.image,
            )
            old = [n for n in state.nodes.values() if n.kind == "client" and n.task == task]
            new = [
                self.reconciler.client_node(task, i, new_rev)
                for i in range(self.recipe.tasks[task].clients)
            ]
            for n in new:
                state.nodes[n.name] = n  # pending: the reconcile loop starts them
        log.info("swap %s: starting %s (%d node(s)) beside %s", task, new_rev.revision,
                 len(new), old_rev.revision)
        since = time.time()
        problem = self._wait_healthy(new, since, healthy_timeout_s)
        if problem:
            log.error("swap %s to %s failed: %s; keeping %s", task, new_rev.revision, problem,
                      old_rev.revision)
            self._retire(new, grace_s=5.0)
            return SwapResult(
                False, f"{problem}; the old revision {old_rev.revision} keeps running",
                new_rev.revision,
            )
        with state.lock:
            state.revisions[task] = new_rev
        state.write_run_json()
        old_revisions = sorted({n.revision for n in old} | {old_rev.revision})
        refused_note = ""
        if drop_old:
            entries = {f"{task}/{r}" for r in old_revisions}
            for model in self.recipe.tasks[task].models:  # a team: every model's server
                if not self._refuse(model, entries):
                    refused_note = f" (server {model} has not confirmed the refusal yet)"
        self._retire(old, grace_s)
        leftovers = self._spool_leftovers(old)
        msg = (
            f"task {task}: {len(new)} node(s) of {new_rev.revision} running; "
            f"{len(old)} node(s) of {', '.join(old_revisions)} drained"
        )
        if drop_old:
            msg += f"; {', '.join(old_revisions)} refused by the server{refused_note}"
        if leftovers:
            msg += f"; un-acked groups left in spool/: {leftovers}"
        log.info("swap %s", msg)
        return SwapResult(True, msg, new_rev.revision)

    def _wait_healthy(self, nodes: Sequence[Node], since: float, timeout_s: float) -> str:
        """'' once every node runs and its status file says running; else why not."""
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if self._stopping.is_set():
                return "the run is stopping"
            with self.state.lock:
                crashing = [n.name for n in nodes if n.restarts >= 2]
                up = [n for n in nodes if n.state == "running"]
            if crashing:
                return (
                    f"new node(s) {', '.join(crashing)} keep exiting: see "
                    f"{self.paths.log(crashing[0])}"
                )
            if len(up) == len(nodes) and all(self._reports_running(n, since) for n in nodes):
                return ""
            time.sleep(0.2)
        waiting = [n.name for n in nodes if not self._reports_running(n, since)]
        return (
            f"new node(s) {', '.join(waiting)} did not report running within {timeout_s:.0f}s: "
            f"see {self.paths.log(waiting[0] if waiting else nodes[0].name)}"
        )

    def _reports_running(self, node: Node, since: float) -> bool:
        report = self.state.reports.get(node.name)
        return report is not None and report.received_at >= since and report.state == "running"

    def _retire(self, nodes: Sequence[Node], grace_s: float) -> None:
        """Drain `nodes` and forget them: the controller no longer restarts or lists them."""
        self.reconciler.drain_nodes(nodes, grace_s, "old client")
        with self.state.lock:
            for n in nodes:
                if n.handle is None and self.state.nodes.get(n.name) is n:
                    del self.state.nodes[n.name]
                    self.state.retired.add(n.name)  # a late sync from it is told to drain
            # runtime: ray: a revision's nodes have a placement group of their own; free it
            # once all of them exited, so that the next swap's bundles fit
            groups: dict[str, bool] = {}  # group -> every node of it exited
            for n in nodes:
                if n.runtime == "ray":
                    group = self.reconciler.placement(n).group
                    groups[group] = groups.get(group, True) and n.handle is None
        ray = self.reconciler.runtimes.get("ray")
        for group, exited in sorted(groups.items()):
            if ray is not None and exited:
                ray.release_group(group)
        self.state.write_run_json()

    def _refuse(self, model: str, entries: set[str], timeout_s: float = 10.0) -> bool:
        """Tell `model`'s server to refuse `entries` (kept in run.json; the server hears it in
        its sync replies); True once its sync shows it enforces them."""
        with self.state.lock:
            self.state.refused[model] = self.state.refused.get(model, frozenset()) | entries
        self.state.write_run_json()
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            report = self.state.reports.get(server_node_name(model))
            if report is not None and entries <= report.refused:
                return True
            time.sleep(0.2)
        log.warning("server %s did not confirm refusing %s within %.0fs", model,
                    sorted(entries), timeout_s)
        return False

    def _spool_leftovers(self, nodes: Sequence[Node]) -> dict[str, int]:
        """Groups the drained nodes could not flush (the spool_depth of their last sync)."""
        left: dict[str, int] = {}
        for n in nodes:
            report = self.state.reports.get(n.name)
            depth = int((report.status if report else {}).get("spool_depth") or 0)
            if depth:
                left[n.name] = depth
        return left
