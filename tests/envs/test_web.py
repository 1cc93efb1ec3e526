"""envs/web: the shop serves real pages; a browser adds to the server's cart; reward from it.

The site tests talk HTTP directly (integration tier); the session tests drive headless
Chromium (browser tier: fails under CI=true when chromium, chromedriver or selenium is
missing, skips otherwise).
"""

from __future__ import annotations

import random
import re
import time
import urllib.error
import urllib.parse
import urllib.request
from collections.abc import Iterator

import pytest

from envs.web import WebEnv, WebSession, WebToolError, browser_problem, make_env
from envs.web.site import PAGE_SIZE
from tests.envs.scripted_llm import ScriptedEndpoint, replies, tool_call
from tests.factories import IN_CI

pytestmark = pytest.mark.timeout(180)


def get(session: WebSession, path: str) -> str:
    with urllib.request.urlopen(session.server.base_url + path, timeout=10) as resp:
        return str(resp.read().decode())


def post(session: WebSession, path: str, form: dict[str, str]) -> int:
    data = urllib.parse.urlencode(form).encode()
    try:
        with urllib.request.urlopen(session.server.base_url + path, data=data, timeout=10) as r:
            return int(r.status)
    except urllib.error.HTTPError as e:
        return e.code


@pytest.fixture
def env() -> WebEnv:
    return make_env(catalog_seed=0)


def browser_session(env: WebEnv, task_index: int = 0) -> WebSession:
    problem = browser_problem()
    if problem:
        if IN_CI:
            pytest.fail(f"the browser tier must run under CI: {problem}")
        pytest.skip(problem)
    product = env.catalog[task_index]
    return env.open(env.task("add", product))


# ---------------------------------------------------------------------------- site (no browser)


@pytest.mark.unit
def test_catalog_and_task_ids_are_stable() -> None:
    a, b = make_env(catalog_seed=3), make_env(catalog_seed=3)
    assert a.catalog == b.catalog and a.catalog != make_env(catalog_seed=4).catalog
    ids = [t.id for _, t in zip(range(12), a.tasks(random.Random(1)))]
    assert ids == [t.id for _, t in zip(range(12), b.tasks(random.Random(1)))]
    assert len({p.price_cents for p in a.catalog}) == len(a.catalog)  # one cheapest per category


@pytest.mark.integration
def test_site_pages_search_pagination_and_cart(env: WebEnv) -> None:
    target = env.catalog[3]
    session = env.open(env.task("add_qty", target, 3))
    try:
        assert "Search products" in get(session, "/")
        found = get(session, "/search?" + urllib.parse.urlencode({"q": target.name.lower()}))
        assert f"/product/{target.slug}" in found
        first = get(session, "/products")
        assert first.count("class='product'") == PAGE_SIZE and "rel='next'" in first
        pages = -(-len(env.catalog) // PAGE_SIZE)
        last = get(session, f"/products?page={pages}")
        assert "rel='next'" not in last and "rel='prev'" in last
        assert "Add to cart" in get(session, f"/product/{target.slug}")
        assert post(session, "/cart/add", {"slug": target.slug, "qty": "0"}) == 400
        assert post(session, "/cart/add", {"slug": "no-such-thing", "qty": "1"}) == 400
        assert session.reward() == 0.0
        assert post(session, "/cart/add", {"slug": target.slug, "qty": "2"}) == 200  # -> /cart
        assert session.reward() == 0.5  # target in the cart, wrong quantity
        post(session, "/cart/add", {"slug": target.slug, "qty": "1"})
        assert session.server.shop.cart == {target.slug: 3} and session.reward() == 1.0
        post(session, "/cart/add", {"slug": env.catalog[0].slug, "qty": "1"})
        assert session.reward() == 0.5  # something else in the cart too
        post(session, "/cart/remove", {"slug": env.catalog[0].slug})
        assert session.reward() == 1.0 and "x 3" in get(session, "/cart")
    finally:
        session.close()


# ---------------------------------------------------------------------------- browser


@pytest.mark.browser
def test_browser_search_and_add_scores_1_and_a_wrong_product_scores_0(env: WebEnv) -> None:
    target = env.catalog[5]
    session = browser_session(env, 5)
    try:
        assert "page 'Shop'" in session.open("/")
        session.fill("#q", target.name)
        assert "/search?q=" in session.submit()
        assert f"page '{target.name}'" in session.click(target.name)
        session.fill("#qty", "1")
        assert "page 'Cart'" in session.submit()
        page = session.read()
        assert f"{target.name} x 1" in page
        assert session.reward() == 1.0
        with pytest.raises(WebToolError, match="only pages of this site"):
            session.open("http://example.com/")
        from selenium.common.exceptions import WebDriverException

        with pytest.raises(WebDriverException, match="ERR_NAME_NOT_RESOLVED"):
            # the same server by name: the browser resolves no names at all
            session.browser.driver.get(f"http://localhost:{session.server.port}/")
        with pytest.raises(WebToolError, match="no element matches"):
            session.click("#does-not-exist")
    finally:
        session.close()
    assert session.closed

    wrong = browser_session(env, 5)
    try:
        other = next(p for p in env.catalog if p.slug != target.slug)
        wrong.open(f"/product/{other.slug}")
        wrong.click("Add to cart")
        assert wrong.server.shop.cart == {other.slug: 1}
        assert wrong.reward() == 0.0
    finally:
        wrong.close()


@pytest.mark.browser
def test_browser_finds_the_cheapest_by_paging_through_a_category(env: WebEnv) -> None:
    category = "garden"
    cheapest = env.cheapest(category)
    task = env.task("cheapest", cheapest)
    problem = browser_problem()
    if problem:
        if IN_CI:
            pytest.fail(f"the browser tier must run under CI: {problem}")
        pytest.skip(problem)
    session = env.open(task)
    try:
        session.open("/")
        session.click("Garden")
        prices: dict[str, float] = {}
        while True:
            for name, price in re.findall(r"^(.+) \$(\d+\.\d\d)$", session.read(), re.MULTILINE):
                prices[name] = float(price)
            if "Next ->" not in session.links():
                break
            session.click("Next")
        assert len(prices) == sum(p.category == category for p in env.catalog)
        best = min(prices, key=lambda n: prices[n])
        session.open("/")  # it may sit on an earlier page: find it by search
        session.fill("#q", best)
        session.submit()
        session.click(best)
        session.submit("#qty")
        assert session.reward() == 1.0
    finally:
        session.close()


@pytest.mark.browser
def test_web_agent_drives_the_browser_through_the_proxy(env: WebEnv) -> None:
    from agents.web import agent

    target = env.catalog[2]
    session = browser_session(env, 2)
    script = replies(
        tool_call("open", url="/"),
        tool_call("fill", selector="#q", text=target.name),
        tool_call("submit"),
        tool_call("click", target=target.name),
        tool_call("fill", selector="#qty", text="1"),
        tool_call("submit", selector="#qty"),
        tool_call("click", target="#nope"),  # a failing action is told to the model
        "The product is in the cart.",
    )
    try:
        with ScriptedEndpoint(script) as endpoint:
            agent(session.task, endpoint.llm, session)
        assert session.reward() == 1.0
        assert len(endpoint.prompts) == 8
        assert "page 'Cart'" in endpoint.prompts[6]  # the submit's result reached the model
        assert "no element matches '#nope'" in endpoint.prompts[7]
    finally:
        session.close()


@pytest.fixture(autouse=True)
def _no_stray_browsers() -> Iterator[None]:
    """Every Chromium a test started is gone when it ends (sessions close their browser)."""
    import psutil

    def chromes() -> set[int]:
        me = psutil.Process()
        return {c.pid for c in me.children(recursive=True) if "chrom" in (c.name() or "").lower()}

    yield
    assert chromes() == set()


@pytest.mark.unit
def test_a_click_that_navigated_is_settled_whatever_chromium_says_about_the_old_page() -> None:
    """Racing a navigation, Chromium may call the old page's node "not in the document"
    instead of stale: the click still navigated, so it waits for the new page, not fails."""
    from selenium.common.exceptions import WebDriverException

    from envs.web.browser import Browser

    class OldPage:
        def is_enabled(self) -> bool:
            raise WebDriverException(
                'unknown error: unhandled inspector error: {"code":-32000,"message":'
                '"Node with given id does not belong to the document"}'
            )

    class Driver:
        def __init__(self) -> None:
            self.states = ["loading", "complete"]

        def execute_script(self, script: str) -> str:
            return self.states.pop(0) if len(self.states) > 1 else self.states[0]

    browser = Browser.__new__(Browser)  # no Chromium: _settle only talks to the driver
    browser.driver = driver = Driver()
    t0 = time.monotonic()
    browser._settle(OldPage(), wait_s=5.0)
    assert time.monotonic() - t0 < 1.0 and driver.states == ["complete"]
