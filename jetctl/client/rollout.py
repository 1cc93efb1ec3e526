"""One rollout in its own killable process: open the env session, run the agent, score it.

The node starts each rollout through `multiprocessing`'s *forkserver* (the agent's and env's
modules and `openai` are preloaded there, so each start is a cheap fork of a warm process,
with none of the node's threads, sockets or event loop). The child makes itself a process
group leader (`os.setpgrp()`), so on timeout `os.killpg(pid, SIGKILL)` also kills whatever
the agent started (browsers, shells, sandboxes). The same group is killed after a normal
finish, so nothing an agent leaves behind outlives its rollout (processes that moved to a
session of their own with `setsid` escape this; envs should close what they open).

With a `registry` folder the runner records each live rollout there (pid and start time),
so a restarted node can kill the groups that its killed predecessor left behind
(`reap_leftovers`).

A broken forkserver is rebuilt, not lived with. A forkserver whose own fork fails (EAGAIN at
a container's pids limit, while an agent's fork bomb holds every pid) dies of it; until
`waitpid` reports it dead, multiprocessing keeps sending starts to its closed socket
(`ConnectionRefusedError`), so a node would drop every group it starts in that window. A
start that fails so kills what is left of the forkserver, forgets it (the next start launches
a fresh one) and tries again with a growing backoff (`START_BACKOFF_S`); one rebuild serves
every rollout that failed on the same forkserver. Only when every try fails does `run` raise
`RolloutPoolError` (its group is dropped as failed, and the next start tries again).

The child sends one `RolloutResult` back over a pipe: reward, status (ok | failed), error
text with traceback, timings, and the spend its session reported (`jetctl.env.Spending`),
a failed one's too. Before that, over the same pipe, it reports what it has spent as it goes
(`Reported`: once its env session is open, and after each `session.cost(...)`, one small
message with the spend so far and its env timings so far, `open_s`), which the parent keeps
in the caller's `Reported`. The parent turns a timeout into status `timeout` and a child that
died without a result into `failed`, each with the spend and env timings it last reported;
their CPU seconds are unknown (the process is killed before it reports them), and their wall
seconds are `rollout_s`. A rollout cancelled under the runner (its group failed) leaves its
last report and wall seconds in `Reported` too.

This module stays light (stdlib, jetctl.env, jetctl.proctree): it is imported by every rollout
process.
"""

from __future__ import annotations

import asyncio
import importlib
import inspect
import logging
import multiprocessing
import multiprocessing.connection
import multiprocessing.context
import os
import resource
import signal
import time
import traceback
from collections.abc import Callable, Mapping
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from jetctl import proctree, tracing
from jetctl.env import LLM, Task, on_cost, spent

log = logging.getLogger(__name__)

MAX_ERROR_CHARS = 16_000  # keeps the result well under a pipe buffer's size
MAIN_ENV = "JETCTL_ROLLOUT_MAIN"  # "path:<file>" or "name:<module>" of the node's __main__
SOFT_PRELOAD_ENV = "JETCTL_ROLLOUT_SOFT_PRELOAD"  # modules prewarm tries to import (comma list)
# waits before each retry of a failed start (the pool is rebuilt before each): ~6 s in all,
# longer than a fork bomb's children live in the attack test (3 s)
START_BACKOFF_S = (0.1, 0.2, 0.4, 0.8, 1.6, 3.2)


class RolloutPoolError(RuntimeError):
    """No rollout process could be started, even from a rebuilt forkserver."""


@dataclass(frozen=True)
class RolloutSpec:
    """Everything the child needs (pickled to it)."""

    env: str  # module:function making the Env
    env_args: dict[str, Any]
    agent: str  # module:function, sync or async
    task: Task
    base_url: str  # this rollout's proxy URL
    model: str
    roles: tuple[str, ...] = ()  # a team task's roles (the names the agent may call)
    traceparent: str = ""  # the rollout's span (jetctl.tracing; "": not traced)


@dataclass
class RolloutResult:
    status: str  # ok | failed | timeout
    reward: float = 0.0  # the shared reward (with per-role rewards: their mean)
    error: str = ""
    error_type: str = ""
    timings: dict[str, float] = field(default_factory=dict)
    role_rewards: dict[str, float] = field(default_factory=dict)  # {}: every role gets reward
    usd: dict[str, float] = field(default_factory=dict)  # kind -> spend the session reported


@dataclass
class Reported:
    """What a rollout has reported so far: the spend its session reported (kind -> USD) and
    its timings (the env's `open_s` while it runs; everything, `rollout_s` included, once it
    ends). The child sends one after its session opens and after each `session.cost(...)`."""

    usd: dict[str, float] = field(default_factory=dict)
    timings: dict[str, float] = field(default_factory=dict)

    def update(self, usd: Mapping[str, float], timings: Mapping[str, float]) -> None:
        self.usd, self.timings = dict(usd), dict(timings)


def read_reward(raw: object) -> tuple[float, dict[str, float]]:
    """`session.reward()` as (shared reward, per-role rewards): a number is every role's
    reward; a mapping role -> number gives each role its own (the shared one is their mean)."""
    if isinstance(raw, Mapping):
        if not raw:
            raise ValueError("session.reward() returned an empty mapping: give each role a reward")
        roles = {str(role): float(value) for role, value in raw.items()}
        return sum(roles.values()) / len(roles), roles
    if isinstance(raw, (int, float)) and not isinstance(raw, bool):
        return float(raw), {}
    raise TypeError(
        f"session.reward() returned {type(raw).__name__}: return a number, or for a team a "
        "mapping role -> number"
    )


def load_object(spec: str) -> Any:
    """Import `module:attr` (attr may be dotted)."""
    module_name, sep, attr = spec.partition(":")
    if not sep or not module_name or not attr:
        raise ValueError(f"{spec!r} is not of the form module:function")
    obj: Any = importlib.import_module(module_name)
    for part in attr.split("."):
        obj = getattr(obj, part)
    return obj


def _call_agent(agent: Callable[..., Any], task: Task, llm: LLM, session: Any) -> None:
    if inspect.iscoroutinefunction(agent):
        asyncio.run(agent(task, llm, session))
        return
    out = agent(task, llm, session)
    if inspect.iscoroutine(out):
        asyncio.run(out)


def child_main(spec: RolloutSpec, conn: multiprocessing.connection.Connection) -> None:
    """Entry point of the rollout process."""
    os.setpgrp()
    os.environ["JET_OPENAI_BASE_URL"] = spec.base_url
    os.environ["OPENAI_BASE_URL"] = spec.base_url
    os.environ.setdefault("OPENAI_API_KEY", "jetctl")
    timings: dict[str, float] = {}
    t0 = time.monotonic()
    session: Any = None  # the env session, once opened (its spend counts even on a failure)
    steps: list[tracing.EnvStep] = []  # the env steps the agent took (traced only)
    try:
        make_env = load_object(spec.env)
        agent = load_object(spec.agent)
        env = make_env(**spec.env_args)
        session = env.open(spec.task)
        timings["open_s"] = time.monotonic() - t0
        if spec.traceparent:  # traced: each env step the agent takes becomes a span
            steps = tracing.record_env_steps(session, t0)
        # the spend so far now and at each session.cost: the node keeps it if it kills us
        on_cost(session, lambda usd: conn.send(Reported(usd, dict(timings))))
        try:
            t1 = time.monotonic()
            llm = LLM(base_url=spec.base_url, model=spec.model, roles=spec.roles)
            _call_agent(agent, spec.task, llm, session)
            timings["agent_s"] = time.monotonic() - t1
            steps = steps[:]  # the agent's steps: not the session's own calls from reward()
            t2 = time.monotonic()
            reward, role_rewards = read_reward(session.reward())
            timings["reward_s"] = time.monotonic() - t2
        finally:
            session.close()
        result = RolloutResult(
            status="ok", reward=reward, timings=timings, role_rewards=role_rewards,
            usd=spent(session),
        )
    except BaseException as e:  # noqa: BLE001  # the rollout's failure is data for the parent, whatever it is
        text = "".join(traceback.format_exception(type(e), e, e.__traceback__))
        if len(text) > MAX_ERROR_CHARS:
            text = text[: MAX_ERROR_CHARS // 2] + "\n...\n" + text[-MAX_ERROR_CHARS // 2 :]
        result = RolloutResult(  # what the session spent before it failed is spent all the same
            status="failed", error=text, error_type=type(e).__name__, timings=timings,
            usd=spent(session),
        )
    # a forked child's counters start at 0; with the children it waited for. getrusage, not
    # os.times: its clock ticks (10 ms) round a short rollout's CPU down to 0
    result.timings["cpu_s"] = sum(
        usage.ru_utime + usage.ru_stime
        for usage in (resource.getrusage(resource.RUSAGE_SELF),
                      resource.getrusage(resource.RUSAGE_CHILDREN)))
    tracing.rollout_process(spec.traceparent, t0, result.timings, steps)
    conn.send(result)
    conn.close()


def main_spec() -> str:
    """How multiprocessing sets up `__main__` in a child of this process ("" if it does not);
    `jetctl.client.prewarm` loads it once in the forkserver."""
    from multiprocessing import spawn

    data = spawn.get_preparation_data("rollout")
    if "init_main_from_name" in data:
        return f"name:{data['init_main_from_name']}"
    if "init_main_from_path" in data:
        return f"path:{data['init_main_from_path']}"
    return ""


def kill_group(pid: int) -> None:
    """SIGKILL the rollout's process group (its leader may already be gone)."""
    try:
        os.killpg(pid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        pass  # no such group: the child died before or right after setpgrp


def reap_leftovers(registry: Path) -> int:
    """Kill the rollout groups recorded in `registry` by an earlier process of this node
    (it was killed before it could); returns how many groups still had processes."""
    reaped = 0
    for entry in registry.glob("*") if registry.is_dir() else ():
        try:
            pid, recorded = int(entry.name), entry.read_text().strip()
        except (ValueError, OSError):
            entry.unlink(missing_ok=True)
            continue
        started = proctree.start_time(pid)
        # the leader may be gone while what it started lives on in its group; a live
        # process with this pid but another start time is someone else: leave it
        if (not started or started == recorded) and proctree.members(pgid=pid):
            kill_group(pid)
            reaped += 1
        entry.unlink(missing_ok=True)
    return reaped


def stop_forkserver() -> None:
    """Kill this process's forkserver, if it has one, and forget it: the next start launches
    a fresh one. (`ForkServer._stop` alone would wait for a hung one forever.)"""
    from multiprocessing import forkserver

    server: Any = forkserver._forkserver  # CPython's ForkServer; its state is private
    pid = server._forkserver_pid
    if pid is None:
        return
    try:
        os.kill(pid, signal.SIGKILL)
    except ProcessLookupError:
        pass  # gone, not yet reaped: _stop reaps it
    try:
        server._stop()  # closes its fds, reaps it, unlinks its socket
    except (ChildProcessError, FileNotFoundError):
        # reaped elsewhere, or its socket already gone: forget it all the same
        server._forkserver_pid = None
        server._forkserver_address = None


class RolloutRunner:
    """Starts rollout processes from a forkserver and waits for them with a timeout."""

    def __init__(
        self,
        preload: list[str],
        max_workers: int = 8,
        registry: Path | None = None,
        soft_preload: list[str] | None = None,
    ) -> None:
        """`preload`: modules the forkserver imports (the env's, the agent's);
        `soft_preload`: modules it tries to import, where a failure is the rollout's to
        report (`jetctl.client.prewarm`)."""
        self._registry = registry
        if registry is not None:
            registry.mkdir(parents=True, exist_ok=True)
        self._ctx = multiprocessing.get_context("forkserver")
        # Only takes effect if this process has not started its forkserver yet. prewarm
        # loads this process's __main__ there once (else every child re-runs it) and
        # resolves openai's lazy imports (see its docstring for the measured costs).
        os.environ[MAIN_ENV] = main_spec()
        os.environ[SOFT_PRELOAD_ENV] = ",".join(soft_preload or [])
        self._ctx.set_forkserver_preload(
            ["openai", "jetctl.env", __name__, *preload, "jetctl.client.prewarm"]
        )
        # Process.start/join block briefly; keep them off the event loop.
        self._executor = ThreadPoolExecutor(
            max_workers=max_workers + 2, thread_name_prefix="rollout"
        )
        self.pool_rebuilds = 0  # forkservers replaced after a failed start
        self._rebuild_lock = asyncio.Lock()

    async def _start(
        self, spec: RolloutSpec, writer: multiprocessing.connection.Connection
    ) -> multiprocessing.context.ForkServerProcess:
        """Start the rollout's process; on a failed start rebuild the pool and try again."""
        loop = asyncio.get_running_loop()
        for attempt, backoff_s in enumerate((*START_BACKOFF_S, None)):
            generation = self.pool_rebuilds
            proc = self._ctx.Process(
                target=child_main, args=(spec, writer), name="jetctl-rollout", daemon=False
            )
            try:
                await loop.run_in_executor(self._executor, proc.start)
                return proc
            except (EOFError, OSError) as e:
                if backoff_s is None:
                    raise RolloutPoolError(
                        f"no rollout process could be started after {attempt + 1} tries, the "
                        f"forkserver rebuilt before each: {type(e).__name__}: {e}"
                    ) from e
                async with self._rebuild_lock:
                    if self.pool_rebuilds == generation:  # else another rollout rebuilt it
                        log.warning(
                            "a rollout process could not start (%s: %s): rebuilding the "
                            "rollout forkserver", type(e).__name__, e,
                        )
                        await loop.run_in_executor(self._executor, stop_forkserver)
                        self.pool_rebuilds += 1
                await asyncio.sleep(backoff_s)
        raise AssertionError("unreachable: the last try returns or raises")

    def shutdown(self) -> None:
        self._executor.shutdown(wait=False, cancel_futures=True)

    async def run(
        self, spec: RolloutSpec, timeout_s: float, reported: Reported | None = None,
        held: Callable[[float], float] | None = None,
    ) -> RolloutResult:
        """Run one rollout; `reported` (the caller's) holds what it reported so far, and once
        it ends its result's spend and timings, even when it is cancelled. `held(t0)`: the
        seconds since `t0` (time.monotonic()) that the rollout's model calls were held for a
        server still starting (the node's proxy before Register); they do not count against
        `timeout_s`."""
        loop = asyncio.get_running_loop()
        reported = Reported() if reported is None else reported
        reader, writer = self._ctx.Pipe(duplex=False)
        t0 = time.monotonic()
        try:
            proc = await self._start(spec, writer)
        except BaseException:
            reader.close()
            raise
        finally:
            writer.close()
        assert proc.pid is not None
        record = self._registry / str(proc.pid) if self._registry is not None else None
        if record is not None:
            record.write_text(proctree.start_time(proc.pid))
        done = loop.create_future()
        results: list[RolloutResult] = []

        def read() -> None:
            """One message of the child's: a report so far, or its result (the wait ends)."""
            if done.done():
                return
            try:
                message = reader.recv()
            except (EOFError, OSError):  # its end is closed: it died (its sentinel says so too)
                message = None
            if isinstance(message, Reported):
                reported.update(message.usd, message.timings)
            else:
                if message is not None:
                    results.append(message)
                done.set_result(None)

        def ended() -> None:
            if not done.done():
                done.set_result(None)

        fd = reader.fileno()
        loop.add_reader(fd, read)
        loop.add_reader(proc.sentinel, ended)
        timed_out = False
        try:
            while not done.done():  # the deadline moves on while calls were held for a server
                allowed = timeout_s + (held(t0) if held is not None else 0.0)
                left = allowed - (time.monotonic() - t0)
                if left <= 0:
                    timed_out = True
                    break
                try:
                    await asyncio.wait_for(asyncio.shield(done), timeout=left)
                    break
                except asyncio.TimeoutError:
                    continue
        except asyncio.CancelledError:
            loop.remove_reader(fd)
            kill_group(proc.pid)
            proc.kill()
            last_reports(reader, reported)  # what it spent before it was stopped
            reported.timings["rollout_s"] = time.monotonic() - t0
            reader.close()
            if record is not None:
                record.unlink(missing_ok=True)
            raise
        finally:
            loop.remove_reader(fd)
            loop.remove_reader(proc.sentinel)

        if timed_out:
            kill_group(proc.pid)  # it reports nothing more: what it sent is what is known
        result = results[0] if results else last_reports(reader, reported)
        reader.close()
        kill_group(proc.pid)
        if proc.is_alive():
            proc.kill()
        await loop.run_in_executor(self._executor, proc.join, 10.0)
        if record is not None:
            record.unlink(missing_ok=True)
        elapsed = time.monotonic() - t0
        if timed_out:
            known = result if result is not None else reported  # a result sent as time ran out
            result = RolloutResult(
                status="timeout",
                error=f"rollout exceeded rollout_timeout_s={timeout_s:g}; killed its process group",
                usd=dict(known.usd), timings=dict(known.timings),
            )
        elif result is None:
            result = RolloutResult(
                status="failed",
                error=f"rollout process exited with code {proc.exitcode} without a result",
                error_type="RolloutProcessDied",
                usd=dict(reported.usd), timings=dict(reported.timings),
            )
        result.timings["rollout_s"] = elapsed
        reported.update(result.usd, result.timings)
        return result


def last_reports(
    reader: multiprocessing.connection.Connection, reported: Reported
) -> RolloutResult | None:
    """Read what the child sent that the event loop has not: its last reports (into
    `reported`), then its result if it sent one (None: it did not, or was cut short)."""
    while reader.poll(0):
        try:
            message = reader.recv()
        except (EOFError, OSError):  # its end is closed, or a message was cut short by a kill
            return None
        if not isinstance(message, Reported):
            result: RolloutResult = message  # the child sends nothing else
            return result
        reported.update(message.usd, message.timings)
    return None
