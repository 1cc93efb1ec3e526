"""`jetctl bench scale`: many client nodes against one server, through a real controller.

    jetctl bench scale --nodes 200 --seconds 60                 # processes on this host
    jetctl bench scale --nodes 200 --ray 127.0.0.1:6379         # node hosts and server on Ray

Starts `jetctl up` on a recipe whose task has no nodes of its own and whose server trains
builtin:tiny, then `hosts` processes (or, with `--ray`, Ray actors in one placement group)
that each run `nodes / hosts` real client nodes in one event loop: each node joins the
controller (`Control.Join`), syncs its status and ledger journal every second, spools its
groups in its own sqlite spool and delivers them with the node's own delivery code. Only the
agent is scripted: every `interval` seconds a node makes one group of G trajectories of
made-up tokens (no rollout process, no model call), so the figures are those of the control
and delivery planes, not of generation. With `--ray` the server is a Ray actor too
(`runtime: ray`).

Measured over `seconds` after a warm-up: groups/s the server accepted, p50/p99 of the
nodes' Submit latency (call to ack, a durable commit on the server), server and controller
RSS and CPU (% of one core), and the latency of `Control.Status` (what `jetctl status`
waits for), with the ledger checked after `jetctl down`.

Left out: rollouts (see `jetctl bench ingest` for the server's ingest ceiling, and the
quickstart for a real agent); one process per node (200 Python processes do not fit this
machine's memory: the nodes share `hosts` processes).
"""

from __future__ import annotations

import asyncio
import json
import logging
import os
import random
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

RECIPE = """
run:
  name: scale
  token: {token}
  control: {{host: {host}, port: {control_port}}}
{ray}
models:
  policy:
    model: builtin:tiny
    finetune: full
    train: {{groups_per_step: 8, max_staleness: 1000000}}
    host: {host}
{server_runtime}
tasks:
  scale:
    env: envs.digits:make_env
    agent: agents.digits:agent
    model: policy
    clients: 0
    group_size: {group_size}
    concurrency: {group_size}
"""


@dataclass
class ScaleResult:
    mode: str  # process | ray
    nodes: int
    hosts: int
    seconds: float
    groups: int  # accepted by the server in the window
    ack_p50_ms: float
    ack_p99_ms: float
    server_rss_mb: float
    server_cpu_pct: float
    controller_rss_mb: float
    controller_cpu_pct: float
    status_p50_ms: float
    status_p99_ms: float
    nodes_running: int
    ledger_balanced: bool
    ledger: dict[str, Any] = field(default_factory=dict)

    @property
    def groups_per_s(self) -> float:
        return self.groups / self.seconds


# ------------------------------------------------------------------ the node hosts


class ScriptedProducer:
    """The fast scripted agent: a group of made-up trajectories every `interval` seconds,
    spooled and delivered exactly as the agent's would be."""

    def __init__(self, node: Any, interval: float, rng: random.Random) -> None:
        self.node, self.interval, self.rng = node, interval, rng
        self.backpressure = False

    async def run(self) -> None:
        from jetctl.proto.convert import group_to_pb
        from jetctl.types import LLMCall, Trajectory, TrajectoryGroup, uuid7

        node, cfg = self.node, self.node.config
        await asyncio.sleep(self.rng.uniform(0, self.interval))  # nodes out of step
        while not node._draining.is_set():
            gid = uuid7()
            ids = [uuid7() for _ in range(cfg.task.group_size)]
            node.spool.start(gid, ids, model=node.model)
            trajectories = [
                Trajectory(
                    id=tid, group_id=gid, task=cfg.task_name, task_id=f"t{i}",
                    client_id=cfg.name, client_revision=cfg.revision,
                    calls=[LLMCall(
                        # ids inside builtin:tiny's vocabulary (733): Submit refuses others
                        model=node.model, prompt_ids=[self.rng.randrange(3, 700) for _ in range(32)],
                        completion_ids=[self.rng.randrange(3, 700) for _ in range(8)],
                        completion_logprobs=[-1.0] * 8, model_version=0,
                    )],
                    reward=float(i % 2),
                )
                for i, tid in enumerate(ids)
            ]
            group = TrajectoryGroup(id=gid, task=cfg.task_name, task_id="scripted",
                                    model=node.model, trajectories=trajectories)
            node.spool.put(gid, group_to_pb(group).SerializeToString(), len(ids),
                           trajectory_ids=ids, model=node.model)
            node.stats.groups_spooled += 1
            node.stats.rollouts_done += len(ids)
            node.delivery.wake()
            try:
                await asyncio.wait_for(node._draining.wait(), timeout=self.interval)
            except asyncio.TimeoutError:
                pass


async def run_nodes(
    control: str, token: str, task: str, count: int, base: int, work_dir: str,
    interval: float, stop_after: float,
) -> dict[str, Any]:
    """`count` scripted client nodes in this event loop, joined to `control`; returns the
    Submit latencies (seconds, one per acked group) once they drained."""
    from jetctl.client.node import ClientNode, NodeConfig
    from jetctl.link import ControlLink
    from jetctl.proto._gen import control_pb2 as cpb
    from jetctl.recipe import TaskConfig

    latencies: list[float] = []

    def on_acked(seconds: float, groups: int) -> None:
        latencies.extend([seconds] * groups)

    async def one(i: int) -> int:
        link = ControlLink(control, token)
        reply = await link.join(cpb.JoinRequest(kind="client", task=task, name=f"{task}-n{i}",
                                                index=i))
        config = NodeConfig(
            name=reply.name, task_name=task, task=TaskConfig.model_validate_json(reply.task_json),
            run_dir=Path(work_dir), token=token, index=reply.index, revision=reply.revision,
            metrics_port=None, install_signal_handlers=False, drain_grace_s=30.0, link=link,
            make_producer=lambda node: ScriptedProducer(node, interval, random.Random(i)),
            on_acked=on_acked,
        )
        node = ClientNode(config)
        nodes.append(node)
        return await node.run()

    nodes: list[Any] = []
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, lambda: [n.drain() for n in nodes])
    runs = [asyncio.create_task(one(base + i)) for i in range(count)]
    if stop_after > 0:
        loop.call_later(stop_after, lambda: [n.drain() for n in nodes])
    codes = await asyncio.gather(*runs)
    return {"latencies": latencies, "exit_codes": codes}


def _host_main(argv: list[str]) -> None:
    """`python -m jetctl.bench.scale host CONTROL TOKEN TASK COUNT BASE WORK INTERVAL`"""
    control, token, task, count, base, work, interval = argv
    result = asyncio.run(run_nodes(control, token, task, int(count), int(base), work,
                                   float(interval), 0.0))
    print(json.dumps(result))


class NodeHost:
    """A Ray actor running a share of the nodes (--ray)."""

    def run(self, control: str, token: str, task: str, count: int, base: int, work: str,
            interval: float, stop_after: float) -> dict[str, Any]:
        return asyncio.run(run_nodes(control, token, task, count, base, work, interval,
                                     stop_after))


# ------------------------------------------------------------------ measuring


def _percentile(values: list[float], q: float) -> float:
    if not values:
        return float("nan")
    values = sorted(values)
    return values[min(len(values) - 1, int(q * len(values)))]


def _cpu_rss(pid: int) -> tuple[float, float]:
    """(user+system CPU seconds, RSS MB) of the process itself (not its children: the
    controller's child is the server under the process runtime)."""
    import psutil

    p = psutil.Process(pid)
    return sum(p.cpu_times()[:2]), p.memory_info().rss / 1e6


def run(
    nodes: int = 200, hosts: int = 4, seconds: float = 60.0, interval: float = 2.0,
    group_size: int = 4, ray_address: str | None = None, warmup_s: float = 20.0,
    say: Any = print,
) -> ScaleResult:
    import grpc

    from jetctl.auth import bearer
    from jetctl.net import free_port, route_address
    from jetctl.proto._gen import control_pb2 as cpb
    from jetctl.proto._gen import control_pb2_grpc as cgrpc
    from jetctl.proto._gen import swarm_pb2 as spb
    from jetctl.proto._gen import swarm_pb2_grpc as sgrpc
    from jetctl.run.ledger import build_ledger

    token = "bench-scale-token"
    # with Ray: this host's address towards the head (loopback for a cluster on this host),
    # or every interface when the head is elsewhere and the server may be placed there
    node_ip = route_address(ray_address) if ray_address else "127.0.0.1"
    host = node_ip if node_ip.startswith("127.") else "0.0.0.0"
    control_port = free_port()
    with tempfile.TemporaryDirectory(prefix="jetctl-scale-") as d:
        work = Path(d)
        ray_block = ""
        if ray_address:
            ray_block = (f"  ray: {{address: '{ray_address}', work_dir: {work / 'ray'}, "
                         f"runtime_env: {{env_vars: {{PYTHONPATH: '{os.getcwd()}'}}}}}}")
        recipe = work / "scale.yaml"
        recipe.write_text(RECIPE.format(
            token=token, host=host, control_port=control_port, ray=ray_block,
            group_size=group_size,
            server_runtime="    runtime: ray" if ray_address else "",
        ))
        run_dir = work / "run"
        env = {**os.environ, "PYTHONPATH": os.getcwd()}
        say(f"starting the controller and the server ({'ray' if ray_address else 'process'})")
        ctl = subprocess.Popen(
            [sys.executable, "-m", "jetctl.cli.main", "controller", str(recipe),
             "--run-dir", str(run_dir)],
            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, env=env,
        )
        control = f"127.0.0.1:{control_port}"
        channel = grpc.insecure_channel(control)
        stub = cgrpc.ControlStub(channel)

        def status() -> cpb.RunStatusReply:
            return stub.Status(cpb.RunStatusRequest(), metadata=bearer(token), timeout=10)

        def server_figures() -> dict[str, Any]:
            for n in status().nodes:
                if n.kind == "server":
                    return dict(json.loads(n.json or "{}"), state=n.state)
            return {}

        try:
            deadline = time.monotonic() + 300
            while time.monotonic() < deadline:
                try:
                    if server_figures().get("state") == "running":
                        break
                except grpc.RpcError:
                    pass
                time.sleep(1.0)
            else:
                raise RuntimeError(f"the server did not come up: see {run_dir}/logs")
            endpoint = next(n.endpoint for n in status().nodes if n.kind == "server")
            server_pid = int(server_figures().get("pid") or 0)
            say(f"server at {endpoint} (pid {server_pid}); starting {nodes} nodes in {hosts} "
                f"{'Ray actors' if ray_address else 'processes'}")
            shares = [nodes // hosts + (i < nodes % hosts) for i in range(hosts)]
            bases = [sum(shares[:i]) for i in range(hosts)]
            total_s = warmup_s + seconds
            if ray_address:
                results = _start_ray_hosts(ray_address, f"{node_ip}:{control_port}", token,
                                           shares, bases,
                                           str(work / "nodes"), interval, total_s + 10)
                host_procs: list[subprocess.Popen[str]] = []
            else:
                host_procs = [
                    subprocess.Popen(
                        [sys.executable, "-m", "jetctl.bench.scale", "host", control, token,
                         "scale", str(n), str(b), str(work / "nodes"), str(interval)],
                        stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True, env=env,
                    )
                    for n, b in zip(shares, bases)
                ]
            time.sleep(warmup_s)
            swarm = sgrpc.SwarmStub(grpc.insecure_channel(endpoint))

            def accepted() -> int:
                reply = swarm.Status(spb.StatusRequest(), metadata=bearer(token), timeout=10)
                return int(reply.accepted_groups)

            running = sum(1 for n in status().nodes if n.kind == "client" and n.state == "running")
            say(f"{running} nodes running; measuring {seconds:.0f}s")
            g0, t0 = accepted(), time.monotonic()
            s0, c0 = _cpu_rss(server_pid), _cpu_rss(ctl.pid)
            status_ms: list[float] = []
            while time.monotonic() - t0 < seconds:
                a = time.perf_counter()
                status()
                status_ms.append((time.perf_counter() - a) * 1e3)
                time.sleep(1.0)
            elapsed = time.monotonic() - t0
            groups = accepted() - g0
            s1, c1 = _cpu_rss(server_pid), _cpu_rss(ctl.pid)
            say("draining the nodes and stopping the run")
            latencies: list[float] = []
            if ray_address:
                import ray

                for r in ray.get(results, timeout=300):
                    latencies += r["latencies"]
            else:
                for p in host_procs:
                    p.send_signal(signal.SIGTERM)
                for p in host_procs:
                    out, _ = p.communicate(timeout=300)
                    latencies += json.loads(out.strip().splitlines()[-1])["latencies"]
            stub.Down(cpb.DownRequest(grace_s=60), metadata=bearer(token), timeout=10)
            ctl.wait(timeout=300)
        finally:
            if ctl.poll() is None:
                ctl.kill()
        ledger = build_ledger(run_dir)
        return ScaleResult(
            mode="ray" if ray_address else "process", nodes=nodes, hosts=hosts,
            seconds=elapsed, groups=groups,
            ack_p50_ms=_percentile(latencies, 0.5) * 1e3,
            ack_p99_ms=_percentile(latencies, 0.99) * 1e3,
            server_rss_mb=s1[1], server_cpu_pct=(s1[0] - s0[0]) / elapsed * 100,
            controller_rss_mb=c1[1], controller_cpu_pct=(c1[0] - c0[0]) / elapsed * 100,
            status_p50_ms=statistics.median(status_ms), status_p99_ms=_percentile(status_ms, 0.99),
            nodes_running=running, ledger_balanced=ledger.balanced, ledger=ledger.summary(),
        )


def _start_ray_hosts(
    address: str, control: str, token: str, shares: list[int], bases: list[int], work: str,
    interval: float, total_s: float,
) -> list[Any]:
    """The node hosts as Ray actors, one bundle each of a SPREAD placement group."""
    import ray
    from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

    from jetctl.net import route_address

    ray.init(address=address, _node_ip_address=route_address(address),
             ignore_reinit_error=True, logging_level=logging.WARNING, log_to_driver=False,
             runtime_env={"env_vars": {"PYTHONPATH": os.getcwd()}})
    pg = ray.util.placement_group([{"CPU": 0.5}] * len(shares), strategy="SPREAD")
    ray.get(pg.ready(), timeout=120)
    actor_class = ray.remote(NodeHost)
    refs = []
    for i, (n, b) in enumerate(zip(shares, bases)):
        actor: Any = actor_class.options(  # type: ignore[attr-defined]
            num_cpus=0.5,
            scheduling_strategy=PlacementGroupSchedulingStrategy(pg, placement_group_bundle_index=i),
        ).remote()
        refs.append(actor.run.remote(control, token, "scale", n, b, work, interval, total_s))
    return refs


def result_json(result: ScaleResult) -> dict[str, Any]:
    out = asdict(result)
    out["groups_per_s"] = result.groups_per_s
    return out


if __name__ == "__main__":
    if len(sys.argv) > 1 and sys.argv[1] == "host":
        _host_main(sys.argv[2:])
    else:
        raise SystemExit("usage: python -m jetctl.bench.scale host ... (jetctl bench scale runs it)")
