"""`jetctl bench tools`: how often a model's rollouts act well formed, per env and level.

Runs N rollouts of each (env, level) before any training: the real env (a real page in
headless Chromium, a real sandbox run, a real rate-limited API), the real agent over the
`openai` SDK, the real OpenAI-compatible proxy of a client node (chat template, tool-call
parsing), and the model generating in this process through the server's batching engine
(`jetctl.server.engines.hf.HFEngine`), so the N rollouts of a level batch together as they do on
a swarm server. Per (env, level) it reports:

    rollouts   N, each on a task drawn from the env's stream (seeded)
    acted      rollouts with at least one well-formed action (a call the session ran)
    calls      model calls made, and how many were well-formed actions
    reward     the mean reward (the env's, with the level's partial credit)

A well-formed action is one the env received: a tool the level offers, with arguments of
the right names (envs/levels.py). Left out: training (see `jetctl up`), several models side
by side in one run (run it once per model).
"""

from __future__ import annotations

import asyncio
import random
import threading
import time
import uuid
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

from jetctl.client.backend import GenerateParams, GenerateResult
from jetctl.client.proxy import Proxy, Sampling, ServedModel
from jetctl.client.rollout import load_object
from jetctl.client.timeline import ChatRenderer
from jetctl.env import LLM

# (env, agent, env_args besides level) of each family, as a recipe would name them
FAMILIES: dict[str, tuple[str, str, dict[str, Any]]] = {
    "web": ("envs.web:make_env", "agents.web:agent", {}),
    "code": ("envs.code:make_env", "agents.code:agent", {}),
    "api": ("envs.api:make_env", "agents.api:agent", {}),
}


@dataclass(frozen=True)
class LevelResult:
    env: str
    level: str
    rollouts: int
    acted: int  # rollouts with at least one well-formed action
    calls: int  # model calls
    well_formed: int  # of those calls, the ones the session ran
    reward: float  # mean
    failed: int  # rollouts that raised
    seconds: float

    @property
    def acted_rate(self) -> float:
        return self.acted / self.rollouts if self.rollouts else 0.0


class _EngineBackend:
    """The proxy's Backend over an in-process HFEngine (version 0: no training here)."""

    def __init__(self, engine: Any) -> None:
        self.engine = engine

    async def generate(self, params: GenerateParams) -> GenerateResult:
        from jetctl.server.engines import GenRequest

        r = await self.engine.generate(
            GenRequest(params.prompt_ids, params.max_tokens, params.temperature, params.top_p,
                       tuple(params.stop_token_ids))
        )  # fmt: skip
        return GenerateResult(r.completion_ids, r.completion_logprobs, 0, r.finish_reason)


@contextmanager
def _serving(
    model_source: str, sampling: Sampling, batch: int
) -> Iterator[tuple[Proxy, asyncio.AbstractEventLoop]]:
    """The proxy with the model behind it, serving from an event loop in a thread."""
    import torch

    from jetctl.models import load_model
    from jetctl.server.engines.hf import HFEngine

    model, tokenizer = load_model(model_source, attn_implementation="sdpa", progress=False)
    eos = tokenizer.eos_token_id
    eos_ids = [eos] if isinstance(eos, int) else list(eos or [])
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else eos_ids[0]
    torch.set_num_threads(max(1, min(torch.get_num_threads(), 4)))
    loop = asyncio.new_event_loop()
    thread = threading.Thread(target=loop.run_forever, name="bench-tools", daemon=True)
    thread.start()

    async def start() -> Proxy:
        engine = HFEngine(model, eos_token_ids=eos_ids, pad_token_id=pad,
                          weights_lock=threading.Lock(), version=lambda: 0,
                          max_batch_size=batch, batch_wait_ms=200)  # fmt: skip
        engine.start()
        served = ServedModel("policy", ChatRenderer(tokenizer, eos_ids), _EngineBackend(engine),
                             max_context_tokens=4096)  # fmt: skip
        proxy = Proxy({"policy": served}, "policy", sampling)
        await proxy.start()
        return proxy

    proxy = asyncio.run_coroutine_threadsafe(start(), loop).result(120)
    try:
        yield proxy, loop
    finally:
        asyncio.run_coroutine_threadsafe(proxy.stop(), loop).result(30)
        loop.call_soon_threadsafe(loop.stop)
        thread.join(10)


def _rollout(
    proxy: Proxy, loop_call: Any, env: Any, agent: Any, task: Any
) -> tuple[int, int, float, bool]:
    """(model calls, well-formed actions, reward, failed) of one rollout."""
    rollout_id = uuid.uuid4().hex
    loop_call(lambda: proxy.open(rollout_id))
    session = env.open(task)
    failed = False
    try:
        agent(task, LLM(base_url=proxy.base_url(rollout_id), model="policy"), session)
    except Exception:  # noqa: BLE001  # a rollout that raises is counted, as a node would
        failed = True
    finally:
        reward = float(session.reward())
        session.close()
        timeline = loop_call(lambda: proxy.close(rollout_id))
    return len(timeline.turns), session.actions.well_formed, reward, failed


def _run_level(
    proxy: Proxy, loop: asyncio.AbstractEventLoop, family: str, level: str, rollouts: int,
    seed: int, concurrency: int, env_args: dict[str, Any],
) -> LevelResult:  # fmt: skip
    """N rollouts of one (env, level), `concurrency` at a time."""
    make_env_path, agent_path, base_args = FAMILIES[family]
    env = load_object(make_env_path)(**{**base_args, **env_args, "level": level})
    agent = load_object(agent_path)
    tasks = [t for _, t in zip(range(rollouts), env.tasks(random.Random(seed)))]

    def loop_call(fn: Any) -> Any:
        async def call() -> Any:
            return fn()

        return asyncio.run_coroutine_threadsafe(call(), loop).result(30)

    t0 = time.monotonic()
    with ThreadPoolExecutor(concurrency) as pool:
        outs = list(pool.map(lambda t: _rollout(proxy, loop_call, env, agent, t), tasks))
    return LevelResult(
        env=family, level=level, rollouts=len(outs),
        acted=sum(1 for _, wf, _, _ in outs if wf > 0),
        calls=sum(c for c, _, _, _ in outs),
        well_formed=sum(min(wf, c) for c, wf, _, _ in outs),
        reward=sum(r for _, _, r, _ in outs) / max(1, len(outs)),
        failed=sum(1 for *_, f in outs if f),
        seconds=time.monotonic() - t0,
    )  # fmt: skip


def run(
    model_source: str,
    families: list[str],
    levels: list[str],
    rollouts: int,
    max_tokens: int,
    seed: int = 0,
    concurrency: int = 8,
    env_args: dict[str, dict[str, Any]] | None = None,
) -> list[LevelResult]:
    """N rollouts per (env, level); see the module docstring."""
    unknown = sorted(set(families) - set(FAMILIES))
    if unknown:
        raise ValueError(f"unknown env {unknown}; choose from {', '.join(FAMILIES)}")
    with _serving(model_source, Sampling(max_tokens=max_tokens), concurrency) as (proxy, loop):
        return [
            _run_level(proxy, loop, family, level, rollouts, seed, concurrency,
                       (env_args or {}).get(family, {}))
            for family in families
            for level in levels
        ]  # fmt: skip
