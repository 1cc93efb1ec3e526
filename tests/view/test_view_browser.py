"""`jetctl view` in real headless Chromium (browser tier: fails under CI=true when chromium,
chromedriver or selenium is missing, skips otherwise): the page loads, a group opens with
its members' tokens, a filter changes the rows, a trace's step link lands on the step."""

from __future__ import annotations

import os
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from envs.web.browser import Browser, browser_problem
from tests.factories import IN_CI
from tests.view.conftest import ViewRun

pytestmark = [pytest.mark.browser, pytest.mark.timeout(180)]
ROOT = Path(__file__).resolve().parents[2]
PAGE_LOAD_TIMEOUT_S = 90
SCREENSHOT = Path(os.environ.get("JETCTL_VIEW_SCREENSHOT", "/tmp/view-group.png"))


@pytest.fixture
def served(view_run: ViewRun) -> Iterator[str]:
    """`jetctl view RUN_DIR --port 0` as a user runs it; the URL it prints."""
    proc = subprocess.Popen(
        [sys.executable, "-m", "jetctl.cli.main", "view", str(view_run.dir), "--port", "0"],
        cwd=ROOT, stdout=subprocess.PIPE, text=True, env={**os.environ, "PYTHONUNBUFFERED": "1"},
    )
    try:
        assert proc.stdout is not None
        url = proc.stdout.readline().strip()
        assert url.startswith("http://127.0.0.1:"), url
        yield url
    finally:
        proc.terminate()
        try:
            proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            proc.kill()  # a server still busy in a request under load
            proc.wait(timeout=10)


@pytest.fixture
def driver(served: str) -> Iterator[Any]:
    problem = browser_problem()
    if problem:
        if IN_CI:
            pytest.fail(f"the browser tier must run under CI: {problem}")
        pytest.skip(problem)
    browser = Browser(served)
    # the first group page loads the run's tokenizer (transformers): slow on a busy machine
    browser.driver.set_page_load_timeout(PAGE_LOAD_TIMEOUT_S)
    try:
        yield browser.driver
    finally:
        browser.close()


def rows(driver: Any) -> list[Any]:
    from selenium.webdriver.common.by import By

    return list(driver.find_elements(By.CSS_SELECTOR, "#groups tr.group"))


def test_explorer_in_chromium(driver: Any, served: str, view_run: ViewRun) -> None:
    from selenium.webdriver.common.by import By
    from selenium.webdriver.support.ui import Select, WebDriverWait

    def arrive(part: str) -> None:
        """A click navigates after it returns: wait for the new page's URL."""
        WebDriverWait(driver, 20).until(lambda d: part in d.current_url)

    driver.get(served)
    assert driver.title.startswith("jetctl view") and len(rows(driver)) == 5
    assert driver.find_elements(By.CSS_SELECTOR, "svg.reward-curve circle")  # the curve drawn

    driver.find_element(By.LINK_TEXT, view_run.trained.id).click()
    arrive(view_run.trained.id)
    members = driver.find_elements(By.CSS_SELECTOR, ".member")
    tokens = [len(m.find_elements(By.CSS_SELECTOR, "span.tok")) for m in members]
    assert tokens == [5, 2]  # 2 + 3 completion tokens over two turns; 2 in one
    counts = [int(c.text) for c in members[0].find_elements(By.CSS_SELECTOR, "span.count")]
    assert counts == [2, 3]
    driver.save_screenshot(str(SCREENSHOT))

    driver.get(served)
    Select(driver.find_element(By.ID, "fate")).select_by_value("stale")
    driver.find_element(By.ID, "apply").click()
    arrive("fate=stale")
    (only,) = rows(driver)
    assert view_run.stale.id in only.text and "refused as stale" in only.text

    driver.get(f"{served.rstrip('/')}/trace/{view_run.trained.trajectories[0].id}")
    driver.find_element(By.CSS_SELECTOR, "a.step-link").click()
    arrive("/step/")
    assert driver.current_url.endswith("/step/policy/2")
    assert driver.find_element(By.TAG_NAME, "h1").text == "policy step 2"
    (trained,) = rows(driver)
    assert view_run.trained.id in trained.text
