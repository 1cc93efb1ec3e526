"""A rollout whose model calls were held for a server still starting (a node starts with its
server: issue 23) does not spend its timeout on that wait, and is still killed once its
timeout ran after the server answered. Real rollout processes; the wait is the node's
proxy's own figure (`Proxy.held_s`)."""

from __future__ import annotations

import asyncio
import time

import pytest

from jetctl.client.proxy import Proxy, Sampling
from jetctl.client.rollout import RolloutRunner, RolloutSpec
from jetctl.env import Task

pytestmark = pytest.mark.integration


def _spec() -> RolloutSpec:
    return RolloutSpec(
        env="tests.client.pool_faults:make_env", env_args={},
        agent="tests.client.held_agents:slow_agent", task=Task(id="t", prompt=""),
        base_url="http://127.0.0.1:9/v1", model="policy",
    )


@pytest.mark.timeout(60)
async def test_the_wait_for_a_starting_server_does_not_count_against_the_timeout() -> None:
    runner = RolloutRunner(preload=[], max_workers=2)
    try:
        # the agent takes 2 s against a 1 s timeout: killed, unless 2 s were held
        plain = await runner.run(_spec(), timeout_s=1.0)
        assert plain.status == "timeout", plain
        held = await runner.run(_spec(), timeout_s=1.0, held=lambda t0: 2.0)
        assert held.status == "ok", held.error
        # held for 0.5 s only: the deadline moved to 1.5 s, the agent still outlasts it
        short = await runner.run(_spec(), timeout_s=1.0, held=lambda _: 0.5)
        assert short.status == "timeout", short
    finally:
        runner.shutdown()


async def test_the_proxy_counts_the_seconds_it_held_calls_until_it_served() -> None:
    proxy = Proxy(None, None, Sampling(1.0, 1.0, 16))
    start = time.monotonic()
    await asyncio.sleep(0.2)
    assert proxy.held_s(start) >= 0.2  # still waiting: the wait so far
    proxy.serve({}, None)
    served = proxy.held_s(start)
    await asyncio.sleep(0.2)
    assert proxy.held_s(start) == served, "after serve the figure stops growing"
    assert proxy.held_s(time.monotonic()) == 0.0, "a rollout started after it waited nothing"
