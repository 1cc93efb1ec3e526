"""The nodes' side of the Control service: `Join` and `Sync`, from any host.

A node (client node or server) never reads or writes the controller's run dir. It joins:

* a node the controller started (process, docker or ray runtime) joins under the name it was
  given and gets its task's (or model's) settings, its revision's agent, the servers'
  endpoints and the revisions its server must refuse;
* a client started by hand on any host (`jetctl client --join ADDR --token T --task T`)
  joins without a name: the controller names it `<task>-j<N>`, counts it in its task and
  shows it in status; it drains on `down` and on a swap like the others;
* a server the user runs (`models.<m>.runtime: external`, `jetctl server --join ...`).

Then it syncs about once a second: its status figures (what `jetctl status` shows), a
server's advertised endpoint and the revisions it enforces, and the next records of its
ledger journal (jetctl.controller.received). The reply carries the servers' endpoints, the
refused revisions, `journal_seq` (how far the controller's copy holds the node's journal,
committed before the reply: the node prunes its journal up to it, jetctl.journal), and
`drain` when the run stops, when a swap retired the node, or when the controller does not
know it. A sync from a client the controller does not know (it restarted,
or the node joined an earlier controller) registers it again as a joined node.
"""

from __future__ import annotations

import json
import logging
import time
from dataclasses import dataclass

from jetctl.controller.received import Received
from jetctl.controller.state import Node, Report, RunState, TaskRevision, server_node_name
from jetctl.journal import Record
from jetctl.logs import LogSink
from jetctl.proto._gen import control_pb2 as cpb

log = logging.getLogger("jetctl.controller")


@dataclass(frozen=True)
class Refusal(Exception):
    """A join the controller refuses; `code` is a grpc.StatusCode name."""

    code: str
    message: str


class Hub:
    def __init__(self, state: RunState, received: Received) -> None:
        self.state = state
        self.recipe = state.recipe
        self.received = received
        self.logs = LogSink(state.paths)  # lines of nodes whose logs are not in this run dir

    # ------------------------------------------------------------------ join

    def join(self, req: cpb.JoinRequest) -> cpb.JoinReply:
        """A node the controller started may always join (a stopping run then tells it to
        drain at its first sync); a node that joins by hand only while the run runs."""
        started_here = req.name in self.state.nodes or req.kind == "server"
        if self.state.phase != "running" and not started_here:
            raise Refusal("FAILED_PRECONDITION", f"the run is {self.state.phase}: no joining")
        if req.kind == "server":
            return self._join_server(req)
        if req.kind != "client":
            raise Refusal("INVALID_ARGUMENT", f"kind must be client or server, not {req.kind!r}")
        if req.task not in self.recipe.tasks:
            tasks = ", ".join(sorted(self.recipe.tasks)) or "none"
            raise Refusal("NOT_FOUND", f"task {req.task!r} is not in the run (tasks: {tasks})")
        with self.state.lock:
            node = self.state.nodes.get(req.name) if req.name else None
            if node is None or node.kind != "client":
                node = self._joined(req.task, req.name, req.revision, req.index, req.host)
            node.host = req.host or node.host
            if not node.managed:
                node.started_at = time.time()
            tcfg = self.recipe.tasks[node.task]
            refused = self.state.refused.get(tcfg.models[0], frozenset())
        log.info("%s joined from %s (task %s, %s)", node.name, req.host or "?", node.task,
                 node.revision)
        return cpb.JoinReply(
            name=node.name, run=self.recipe.run.name, revision=node.revision, index=node.index,
            agent=node.agent or tcfg.agent, task_json=tcfg.model_dump_json(exclude_unset=True),
            tls_mode=self.recipe.run.tls.mode, servers=self.state.servers(),
            refused_revisions=sorted(refused), deterministic=self.recipe.run.deterministic,
            ship_logs=_ships_logs(node),
        )

    def _joined(self, task: str, name: str, revision: str, index: int, host: str) -> Node:
        """A client node the controller did not start, added to its task (under the lock)."""
        current = self.state.revisions[task]
        rev = TaskRevision(revision=revision) if revision else current
        taken = {n.index for n in self.state.nodes.values() if n.task == task}
        taken |= set(range(self.recipe.tasks[task].clients))
        if index < 0 or index in taken:
            index = max(taken, default=-1) + 1
        name = name or f"{task}-j{index}"
        tcfg = self.recipe.tasks[task]
        node = Node(
            name=name, kind="client", model=tcfg.models[0], task=task, index=index,
            revision=rev.revision, state="running", runtime="joined",
            agent=rev.agent if rev.revision == current.revision else None, host=host,
            started_at=time.time(),
        )
        self.state.nodes[name] = node
        return node

    def _join_server(self, req: cpb.JoinRequest) -> cpb.JoinReply:
        if req.model not in self.recipe.models:
            known = ", ".join(sorted(self.recipe.models)) or "none"
            raise Refusal("NOT_FOUND", f"model {req.model!r} is not in the run (models: {known})")
        name = server_node_name(req.model)
        with self.state.lock:
            node = self.state.nodes[name]
            node.host = req.host or node.host
            if not node.managed:  # runtime: external: it runs now
                node.state, node.started_at = "starting", time.time()
            refused = self.state.refused.get(req.model, frozenset())
        return cpb.JoinReply(
            name=name, run=self.recipe.run.name,
            model_json=self.recipe.models[req.model].model_dump_json(exclude_unset=True),
            tls_mode=self.recipe.run.tls.mode, refused_revisions=sorted(refused),
            recipe_json=self.recipe.model_dump_json(exclude={"run": {"token"}}),
            ship_logs=_ships_logs(node),
        )

    # ------------------------------------------------------------------ sync

    def sync(self, req: cpb.SyncRequest) -> cpb.SyncReply:
        now = time.time()
        try:
            status = json.loads(req.status_json or "{}")
        except ValueError:
            status = {}
        report = Report(
            status=status if isinstance(status, dict) else {}, received_at=now,
            kind=req.kind, host=req.host,
            endpoint=req.endpoint, metrics=req.metrics,
            refused=frozenset(req.refused_revisions), final=req.final,
        )
        with self.state.lock:
            node = self.state.nodes.get(req.name)
            retired = req.name in self.state.retired
            if (
                node is None and not retired and req.kind == "client"
                and req.task in self.recipe.tasks and self.state.phase == "running"
            ):
                node = self._joined(req.task, req.name, req.revision, -1, req.host)
                log.info("%s synced without joining this controller: counted as joined", node.name)
            if node is not None:
                self.state.reports[node.name] = report
                node.host = req.host or node.host
                if node.kind == "server" and req.endpoint:
                    node.endpoint, node.metrics = req.endpoint, req.metrics
                drain = node.state in ("draining", "exited") or self._refuses(node)
            else:
                drain = True
            refused = self.state.refused.get(node.model if node else req.model, frozenset())
            servers = self.state.servers()
            # a server refuses the credentials of the nodes a swap retired (jetctl.auth)
            revoked = sorted(self.state.retired) if req.kind == "server" else []
        held = self._apply(req)
        if req.log_lines and node is not None and _ships_logs(node):
            self.logs.write(node.name, list(req.log_lines))
        message = ""
        if node is None:
            message = f"the controller does not know {req.name!r} (retired, or the run ended)"
        elif drain:
            message = f"{node.name}: drain ({'the run stops' if self.state.phase != 'running' else 'retired'})"
        return cpb.SyncReply(
            servers=servers, refused_revisions=sorted(refused), drain=drain,
            journal_seq=held, message=message, known=node is not None, revoked_nodes=revoked,
        )

    def _refuses(self, node: Node) -> bool:
        """The node's revision is refused by its model's server (swap --drop-old)."""
        if node.kind != "client":
            return False
        refused = self.state.refused.get(node.model, frozenset())
        return node.revision in refused or f"{node.task}/{node.revision}" in refused

    def _apply(self, req: cpb.SyncRequest) -> int:
        if not req.journal:
            return 0
        source = req.model if req.kind == "server" else req.name
        records = [Record(r.seq, r.table, r.op, r.key, r.data) for r in req.records]
        return self.received.apply(
            name=source, kind=req.kind, journal=req.journal, records=records, final=req.final
        )


def _ships_logs(node: Node) -> bool:
    """A node whose log files are not in this run dir: one that joined by hand or a server
    the user runs (another host, or another run dir), and a Ray actor's node (its host's
    work dir). The process and docker runtimes write to this run dir's logs/ already."""
    return not node.managed or node.runtime == "ray"
