"""Levels of the web, code and api envs: the easy level's real machinery, prior exchange,
horizon and partial credit, through the real agent and proxy (a scripted model).

Browser tests drive headless Chromium (browser tier), the code test a bwrap sandbox
(integration tier); under CI=true a missing part fails them instead of skipping.
"""

from __future__ import annotations

import io
import json
import random
from typing import Any

import pytest

from envs.levels import WELL_FORMED_WEIGHT, ActionLog, check_level, easy_reward
from tests.envs.scripted_llm import ScriptedEndpoint, replies, tool_call
from tests.factories import IN_CI

pytestmark = pytest.mark.timeout(180)


def _skip_or_fail(problem: str | None) -> None:
    if problem:
        if IN_CI:
            pytest.fail(f"this tier must run under CI: {problem}")
        pytest.skip(problem)


# ---------------------------------------------------------------------------- unit


@pytest.mark.unit
def test_a_level_that_does_not_exist_is_refused_naming_the_levels() -> None:
    from envs.api import make_env as api_env
    from envs.code import make_env as code_env
    from envs.web import make_env as web_env

    for make in (web_env, code_env, api_env):
        with pytest.raises(ValueError, match=r"level \('medium'\) must be one of easy, hard"):
            make(level="medium")
    assert check_level("easy") == "easy"


@pytest.mark.unit
def test_easy_reward_is_a_fifth_for_form_and_the_rest_for_the_task() -> None:
    assert easy_reward(0.0, 0, 1) == 0.0
    assert easy_reward(0.0, 1, 1) == pytest.approx(WELL_FORMED_WEIGHT) == pytest.approx(0.2)
    assert easy_reward(1.0, 1, 1) == pytest.approx(1.0)
    assert easy_reward(0.5, 3, 1) == pytest.approx(0.2 + 0.4)  # more actions than the budget
    assert easy_reward(0.0, 1, 2) == pytest.approx(0.1)


@pytest.mark.unit
def test_the_action_log_is_one_json_line() -> None:
    log = ActionLog("web", "easy", "web-easy-x")
    log.record("click", {"target": "Add X"}, "page 'Cart' at /cart" + "." * 1000)
    out = io.StringIO()
    log.dump(1.0, out)
    line = json.loads(out.getvalue())
    assert line["actions"]["steps"][0]["tool"] == "click" and line["actions"]["reward"] == 1.0
    assert len(line["actions"]["steps"][0]["result"]) == 300
    assert out.getvalue().count("\n") == 1


@pytest.mark.unit
def test_easy_tasks_never_ask_their_example_and_hard_tasks_are_unchanged() -> None:
    from envs.api import make_env as api_env
    from envs.code import make_env as code_env
    from envs.code.problems import EASY_EXAMPLE
    from envs.web import make_env as web_env
    from envs.web.env import EXAMPLE_PRODUCT

    rng = random.Random(0)
    web = web_env(level="easy")
    example = web.catalog[EXAMPLE_PRODUCT]
    assert all(t.data["slug"] != example.slug for _, t in zip(range(200), web.tasks(rng)))
    code = code_env(level="easy")
    assert all(t.data["problem"] != EASY_EXAMPLE.id for t in code.all_tasks())
    api = api_env(level="easy")
    first = api.data.orders[0].id
    assert all(first not in t.prompt for _, t in zip(range(200), api.tasks(rng)))
    # the hard level's task stream is the one it always was
    ids = [t.id for _, t in zip(range(6), web_env().tasks(random.Random(1)))]
    assert ids == [t.id for _, t in zip(range(6), web_env(level="hard").tasks(random.Random(1)))]
    assert not any("easy" in i for i in ids)


@pytest.mark.unit
def test_a_session_refuses_a_task_of_another_level() -> None:
    from envs.api import make_env as api_env

    easy, hard = api_env(level="easy"), api_env(level="hard")
    task = next(easy.tasks(random.Random(0)))
    with pytest.raises(ValueError, match="not a task of the hard level"):
        hard.open(task)


# ---------------------------------------------------------------------------- web (browser)


def _web_session(task_index: int = 0) -> Any:
    from envs.web import browser_problem
    from envs.web import make_env as web_env

    _skip_or_fail(browser_problem())
    env = web_env(level="easy", log_actions=True)
    task = [t for _, t in zip(range(task_index + 1), env.tasks(random.Random(3)))][-1]
    return env, env.open(task)


@pytest.mark.browser
def test_web_easy_shows_the_real_page_after_a_prior_exchange_and_scores_the_cart(
    capsys: pytest.CaptureFixture[str],
) -> None:
    from agents.web import agent
    from envs.web.env import EXAMPLE_PRODUCT, listing_text, page_text, start_page

    env, session = _web_session()
    name = session.task.data["name"]
    try:
        with ScriptedEndpoint(replies(tool_call("click", target=f"Add {name}"))) as endpoint:
            agent(session.task, endpoint.llm, session)
        prompt = endpoint.prompts[0]
        assert len(endpoint.prompts) == 1  # the easy horizon: one action
        example = env.catalog[EXAMPLE_PRODUCT]
        # the prior exchange: another product's task, then the call, rendered by the template
        assert f"Add one {example.name} to the cart" in prompt
        assert f'"arguments": {{"target": "Add {example.name}"}}' in prompt
        assert "<tool_response>" not in prompt  # the example shows the call, not its result
        # the task comes with the page the browser shows, and the example's page is the same
        # text the browser shows on its page
        session.browser.open(start_page(env.catalog, example))
        assert page_text(session.browser.read()) == listing_text(env.catalog, example)
        assert f"Add {name}" in prompt.split(f"Add one {name} to the cart")[-1]
        assert '"name": "click"' in prompt and '"name": "open"' not in prompt  # one tool
        assert session.server.shop.cart == {session.task.data["slug"]: 1}
        assert session.reward() == pytest.approx(1.0)
    finally:
        session.close()
    logged = json.loads(capsys.readouterr().err.strip().splitlines()[-1])["actions"]
    assert logged["env"] == "web" and logged["level"] == "easy" and logged["reward"] == 1.0
    assert logged["steps"] == [
        {"tool": "click", "args": {"target": f"Add {name}"}, "result": "page 'Cart' at /cart"}
    ]


@pytest.mark.browser
def test_web_easy_partial_credit_for_a_well_formed_wrong_click_none_without_a_call() -> None:
    from agents.web import agent
    from envs.web.env import listing_text

    env, session = _web_session(1)
    target = next(p for p in env.catalog if p.slug == session.task.data["slug"])
    page = listing_text(env.catalog, target)  # another product on the same page
    other = next(p for p in env.catalog if p != target and f"Add {p.name}" in page)
    try:
        with ScriptedEndpoint(replies(tool_call("click", target=f"Add {other.name}"))) as ep:
            agent(session.task, ep.llm, session)
        assert session.server.shop.cart == {other.slug: 1}
        assert session.reward() == pytest.approx(0.2)
    finally:
        session.close()

    env, session = _web_session(2)
    try:
        with ScriptedEndpoint(replies("I would click the button.")) as endpoint:
            agent(session.task, endpoint.llm, session)
        assert session.reward() == 0.0 and session.server.shop.cart == {}
    finally:
        session.close()


# ---------------------------------------------------------------------------- code (bwrap)


@pytest.mark.integration
def test_code_easy_grades_the_submitted_one_liner_in_the_sandbox() -> None:
    from agents.code import agent
    from envs.code import SandboxUnavailable, make_env, make_sandbox
    from envs.code.problems import EASY_EXAMPLE

    try:
        make_sandbox("bwrap", "unused: bwrap runs no image")
    except SandboxUnavailable as e:
        _skip_or_fail(str(e))
    env = make_env(backend="bwrap", time_limit_s=3.0, level="easy", log_actions=True)
    task = next(t for t in env.all_tasks() if t.data["problem"] == "easy-times_five")
    outcomes = {}
    for code in ("def times_five(x): return x * 5", "def times_five(x): return x + 5"):
        session = env.open(task)
        with ScriptedEndpoint(replies(tool_call("submit", code=code))) as endpoint:
            agent(task, endpoint.llm, session)
        outcomes[code] = (session.reward(), session.graded)
        session.close()
    right, wrong = outcomes.values()
    assert right[0] == pytest.approx(1.0) and right[1] is not None and right[1].passed == 5
    # x + 5 equals x * 5 on none of the hidden cases (0, 1, 4, -3, 10): form credit only
    assert wrong[0] == pytest.approx(0.2) and wrong[1] is not None and wrong[1].passed == 0
    prompt = endpoint.prompts[0]
    assert EASY_EXAMPLE.reference.strip() in prompt.replace("\\n", "\n")  # the prior exchange
    assert '"name": "run_python"' not in prompt  # the easy level offers submit only

    # code answered without the call is not graded at the easy level (no fallback)
    session = env.open(task)
    fenced = "```python\ndef times_five(x): return x * 5\n```"
    with ScriptedEndpoint(replies(fenced)) as endpoint:
        agent(task, endpoint.llm, session)
    assert not session.done and session.reward() == 0.0
    session.close()


# ---------------------------------------------------------------------------- api


@pytest.mark.integration
def test_api_easy_scores_the_resource_the_service_served() -> None:
    from agents.api import agent
    from envs.api import make_env

    env = make_env(api_key="k-" + "x" * 20, level="easy", rate_per_s=1.0, burst=1)
    tasks = {t.data["kind"]: t for _, t in zip(range(50), env.tasks(random.Random(0)))}
    assert set(tasks) == {"order", "user", "user_orders"}
    for kind, task in tasks.items():
        session = env.open(task)
        try:
            with ScriptedEndpoint(replies(tool_call("get", path=task.data["path"]))) as ep:
                agent(task, ep.llm, session)
            assert session.reward() == pytest.approx(1.0), kind
            assert "Bearer" not in ep.prompts[0] and env.api_key.reveal() not in ep.prompts[0]
            assert f'"path": "/v1/orders/{env.data.orders[0].id}"' in ep.prompts[0]  # example
        finally:
            session.close()
    # a well-formed call for another resource: form credit; a 404 path: the same
    for path in (tasks["order"].data["path"] + "9", "/v1/nothing"):
        session = env.open(tasks["user"])
        try:
            with ScriptedEndpoint(replies(tool_call("get", path=path))) as ep:
                agent(tasks["user"], ep.llm, session)
            assert session.reward() == pytest.approx(0.2), path
        finally:
            session.close()
    # the credential and the rate limit are the real ones: a burst of 1 at 1/s
    session = env.open(tasks["order"])
    try:
        session.get("/v1/users/u101")
        assert "waited" in session.get(tasks["order"].data["path"])
        assert session.task_score() == 1.0 and session.server.state.limiter.limited >= 1
    finally:
        session.close()


# ---------------------------------------------------------------------------- tool-call formats


@pytest.mark.integration
def test_the_agent_gets_openai_tool_calls_whatever_format_the_template_declares() -> None:
    """A model whose template declares Llama's JSON calls answers in that format; the same
    agent acts on the same env, because the proxy hands it OpenAI tool_calls."""
    from agents.api import agent
    from envs.api import make_env
    from jetctl.client.timeline import tool_call_formats
    from jetctl.models import chatml_template

    # the builtin template, declaring Llama 3's `<|python_tag|>` instead of `<tool_call>`
    llama_template = chatml_template().replace("<tool_call>", "<|python_tag|>")
    assert tool_call_formats(llama_template) == ("llama_json",)
    env = make_env(level="easy")
    task = next(env.tasks(random.Random(1)))
    hermes = tool_call("get", path=task.data["path"])
    llama = json.dumps({"name": "get", "parameters": {"path": task.data["path"]}})
    for template, reply, reward in ((None, hermes, 1.0), (llama_template, llama, 1.0),
                                    (llama_template, hermes, 0.0)):  # fmt: skip
        session = env.open(task)
        try:
            with ScriptedEndpoint(replies(reply), chat_template=template) as endpoint:
                agent(task, endpoint.llm, session)
            assert session.reward() == pytest.approx(reward), (template is None, reply)
            assert endpoint.timeline is not None
            finish = endpoint.timeline.turns[0].call.finish_reason
            assert finish == ("tool_calls" if reward else "stop")
        finally:
            session.close()
