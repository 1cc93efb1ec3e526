"""envs/api: multi-call tasks scored from the service's state, 401/429 + Retry-After, no leaks."""

from __future__ import annotations

import json
import logging
import time
import urllib.error
import urllib.request
from typing import Any

import pytest

from envs.api import ApiEnv, ApiSession, RateLimiter, make_dataset, make_env
from jetctl.env import LLM, Task
from tests.envs.scripted_llm import ScriptedEndpoint, replies, tool_call

pytestmark = pytest.mark.timeout(120)

SECRET = "sk-test-DO-NOT-LEAK-8f3a91c2"


def solve(session: ApiSession, user_name: str) -> int:
    """A scripted solver of a shipped_total task: several calls, like an agent would make."""
    users = json.loads(session.request("GET", f"/v1/users?name={user_name.split()[1]}").body)
    user = next(u for u in users["users"] if u["name"] == user_name)
    total, page = 0, 1
    while page is not None:
        listing = json.loads(
            session.request("GET", f"/v1/users/{user['id']}/orders?page={page}").body
        )
        for order in listing["orders"]:
            detail = json.loads(session.request("GET", f"/v1/orders/{order['id']}").body)
            if detail["status"] == "shipped":
                total += sum(i["qty"] * i["unit_price_cents"] for i in detail["items"])
        page = listing["next_page"]
    return total


def raw(session: ApiSession, path: str, key: str | None) -> tuple[int, dict[str, str], Any]:
    """A request without the session's help (own credential, no retry)."""
    req = urllib.request.Request(session.server.base_url + path)
    if key is not None:
        req.add_header("Authorization", f"Bearer {key}")
    try:
        with urllib.request.urlopen(req, timeout=10) as resp:
            return resp.status, dict(resp.headers), json.loads(resp.read())
    except urllib.error.HTTPError as e:
        return e.code, dict(e.headers), json.loads(e.read())


def shipped_task(env: ApiEnv) -> tuple[Task, str]:
    """The first user's shipped_total task whose answer is not 0 (a guess could hit 0)."""
    task, user = next(
        (t, u) for u in env.data.users if (t := env.task("shipped_total", u)).data["answer"] > 0
    )
    return task, user.name


# ---------------------------------------------------------------------------- unit


@pytest.mark.unit
def test_secret_hides_itself_and_an_empty_key_is_refused() -> None:
    env = make_env(api_key=SECRET)
    assert SECRET not in repr(env) and SECRET not in str(env.api_key)
    assert env.api_key.reveal() == SECRET
    with pytest.raises(ValueError, match=r"api_key is empty"):
        make_env(api_key="  ")


@pytest.mark.unit
def test_rate_limiter_answers_retry_after_and_counts_early_retries() -> None:
    limiter = RateLimiter(rate_per_s=2.0, burst=3)
    assert [limiter.take() for _ in range(3)] == [0, 0, 0]
    assert limiter.take() == 1  # (1 - ~0 tokens) / 2 per s, rounded up to whole seconds
    assert limiter.early_retries == 0
    limiter.take()  # straight back, before Retry-After passed
    assert limiter.early_retries == 1 and limiter.limited == 2


@pytest.mark.unit
def test_dataset_and_task_ids_are_stable() -> None:
    assert make_dataset(3) == make_dataset(3) and make_dataset(3) != make_dataset(4)
    import random

    a = [t.id for _, t in zip(range(10), make_env(seed=1).tasks(random.Random(7)))]
    b = [t.id for _, t in zip(range(10), make_env(seed=1).tasks(random.Random(7)))]
    assert a == b and all(t.startswith("api-") for t in a)


# ---------------------------------------------------------------------------- service


@pytest.mark.integration
def test_correct_answer_scores_1_and_wrong_scores_0() -> None:
    env = make_env(api_key=SECRET, burst=100)
    task, name = shipped_task(env)
    session = env.open(task)
    try:
        answer = solve(session, name)
        assert answer == task.data["answer"] > 0
        reply = session.request("POST", "/v1/answers", {"task_id": task.id, "answer": answer})
        assert reply.status == 200 and session.reward() == 1.0 and session.answered
        assert session.calls >= 4  # user, at least one order page, orders, answer
    finally:
        session.close()

    wrong = env.open(task)
    try:
        wrong.request("POST", "/v1/answers", {"task_id": task.id, "answer": answer + 1})
        again = wrong.request("POST", "/v1/answers", {"task_id": task.id, "answer": answer})
        assert again.status == 409 and wrong.reward() == 0.0  # only the first answer counts
    finally:
        wrong.close()

    units_env = make_env(api_key=SECRET, burst=100)
    user = units_env.data.users[2]
    units = units_env.task("units", user, "Gadget")
    expected = sum(
        i.qty for o in units_env.data.orders_of(user.id) if o.status != "cancelled"
        for i in o.items if i.product == "Gadget"
    )  # fmt: skip
    assert units.data["answer"] == expected


@pytest.mark.integration
def test_credentials_are_required() -> None:
    env = make_env(api_key=SECRET)
    session = env.open(shipped_task(env)[0])
    try:
        status, headers, _ = raw(session, "/v1/users?name=a", None)
        assert status == 401 and "Bearer" in headers["WWW-Authenticate"]
        assert raw(session, "/v1/users?name=a", "wrong-key")[0] == 401
        assert raw(session, "/v1/users?name=a", SECRET)[0] == 200
        assert session.server.state.unauthorized == 2
    finally:
        session.close()


@pytest.mark.integration
def test_429_with_retry_after_is_observed_and_honoured() -> None:
    env = make_env(api_key=SECRET, rate_per_s=1.0, burst=2)
    session = env.open(shipped_task(env)[0])
    try:
        codes = [raw(session, "/v1/users?name=a", SECRET)[0] for _ in range(2)]
        status, headers, body = raw(session, "/v1/users?name=a", SECRET)
        assert codes == [200, 200] and status == 429
        assert headers["Retry-After"] == "1" and body["retry_after"] == 1
        time.sleep(1.0)  # honour it
        t0 = time.monotonic()
        first = session.request("GET", "/v1/users?name=a")  # the bucket refilled one request
        second = session.request("GET", "/v1/users?name=a")  # limited: the session waits
        assert first.status == 200 and first.waited_s == 0
        assert second.status == 200 and second.waited_s >= 1 and time.monotonic() - t0 >= 1
        assert "waited 1s for the rate limit" in session.http("GET", "/v1/users?name=a")
        limiter = session.server.state.limiter
        assert limiter.limited >= 3 and limiter.early_retries == 0
        raw(session, "/v1/users?name=a", SECRET)  # an impatient client is counted
        raw(session, "/v1/users?name=a", SECRET)
        assert limiter.early_retries >= 1
    finally:
        session.close()


@pytest.mark.integration
def test_only_paths_on_the_service_are_called() -> None:
    from envs.api import ApiToolError

    env = make_env(api_key=SECRET)
    session = env.open(shipped_task(env)[0])
    try:
        for path in ("http://evil.example/steal", "//evil.example/x", "v1/users"):
            with pytest.raises(ApiToolError, match="path must start"):
                session.http("GET", path)
        with pytest.raises(ApiToolError, match="method"):
            session.http("DELETE", "/v1/users/u101")
    finally:
        session.close()


# ---------------------------------------------------------------------------- secrets


def failing_agent(task: Task, llm: LLM, session: ApiSession) -> None:
    """Works a little (a 404, a 401 through a raw call), then crashes, mentioning the session."""
    session.http("GET", "/v1/nowhere")
    raw(session, "/v1/users?name=a", "wrong")
    raise RuntimeError(f"deliberate crash in {session!r} with env args of {task.id}")


@pytest.mark.integration
async def test_secret_never_reaches_logs_errors_or_the_model(
    caplog: pytest.LogCaptureFixture,
) -> None:
    from jetctl.client.rollout import RolloutRunner, RolloutSpec

    caplog.set_level(logging.DEBUG)
    env = make_env(api_key=SECRET, rate_per_s=2.0, burst=2)
    task, name = shipped_task(env)
    # a whole rollout in its own process, as the node runs it: the error text it reports
    runner = RolloutRunner(preload=[])
    try:
        spec = RolloutSpec(
            env="envs.api:make_env",
            env_args={"api_key": SECRET},
            agent="tests.envs.test_api:failing_agent",
            task=task,
            base_url="http://127.0.0.1:9/v1",
            model="policy",
        )
        result = await runner.run(spec, timeout_s=60)
    finally:
        runner.shutdown()
    assert result.status == "failed" and "deliberate crash" in result.error, result
    assert SECRET not in result.error

    # the agent loop through the proxy: the model sees tool results, never the key
    from agents.api import agent

    session = env.open(task)
    answer = task.data["answer"]
    uid = next(u.id for u in env.data.users if u.name == name)
    script = replies(
        tool_call("http", method="GET", path=f"/v1/users?name={name.split()[1]}"),
        tool_call("http", method="GET", path=f"/v1/users/{uid}/orders?page=1"),
        tool_call("http", method="GET", path="/v1/users/u999/orders"),  # a 404
        tool_call("http", method="POST", path="/v1/answers",
                  body={"task_id": task.id, "answer": answer}),
    )  # fmt: skip
    try:
        with ScriptedEndpoint(script) as endpoint:
            await _in_thread(agent, task, endpoint.llm, session)
            assert endpoint.timeline is not None
            recorded = json.dumps([t.prompt_text for t in endpoint.timeline.turns])
        assert session.reward() == 1.0
        assert SECRET not in recorded and all(SECRET not in p for p in endpoint.prompts)
        assert "/v1/orders" in caplog.text or "/v1/users" in caplog.text  # requests were logged
        assert SECRET not in caplog.text
    finally:
        session.close()


async def _in_thread(fn: Any, *args: Any) -> None:
    import asyncio

    await asyncio.to_thread(fn, *args)


# ---------------------------------------------------------------------------- agent


@pytest.mark.integration
def test_api_agent_solves_a_task_through_the_proxy_under_the_rate_limit() -> None:
    from agents.api import agent

    env = make_env(api_key=SECRET, rate_per_s=2.0, burst=2)
    task, name = shipped_task(env)
    uid = next(u.id for u in env.data.users if u.name == name)
    orders = env.data.orders_of(uid)
    pages = -(-len(orders) // 3)
    script = replies(
        tool_call("http", method="GET", path=f"/v1/users?name={name.split()[1]}"),
        *[tool_call("http", method="GET", path=f"/v1/users/{uid}/orders?page={p}")
          for p in range(1, pages + 1)],
        *[tool_call("http", method="GET", path=f"/v1/orders/{o.id}") for o in orders],
        tool_call("http", method="POST", path="/v1/answers",
                  body=json.dumps({"task_id": task.id, "answer": task.data["answer"]})),
        "never asked: the loop stops once the task is answered",
    )  # fmt: skip
    session = env.open(task)
    try:
        with ScriptedEndpoint(script) as endpoint:
            agent(task, endpoint.llm, session)
        assert session.reward() == 1.0
        assert len(endpoint.prompts) == 2 + pages + len(orders)
        assert any("waited 1s for the rate limit" in p for p in endpoint.prompts)
        assert uid not in endpoint.prompts[0] and uid in endpoint.prompts[1]  # a tool result
        assert session.server.state.limiter.early_retries == 0
    finally:
        session.close()


@pytest.mark.unit
def test_tool_loop_answers_bad_calls_with_text() -> None:
    from agents.tool_loop import Tool, call_tool, text_arg
    from envs.api import ApiToolError

    def echo(word: str, times: str = "1") -> str:
        if word == "refuse":
            raise ApiToolError("refused by the env")
        return word * int(times)

    tools = {"echo": Tool("echo", "", {"word": text_arg(""), "times": text_arg("")}, echo,
                          optional=("times",))}  # fmt: skip
    errors = (ApiToolError,)
    assert call_tool(tools, "echo", '{"word": "ab", "times": 2}', errors) == "abab"
    assert call_tool(tools, "nope", "{}", errors).startswith("error: no tool 'nope'")
    assert call_tool(tools, "echo", "{not json", errors).startswith("error: arguments are not JSON")
    assert "missing: word" in call_tool(tools, "echo", "{}", errors)
    assert "unknown: x" in call_tool(tools, "echo", '{"word": "a", "x": 1}', errors)
    assert call_tool(tools, "echo", '{"word": "refuse"}', errors) == "error: refused by the env"
