"""Headless Chromium through Selenium, kept on one site: the web env's browser tools.

Flags are the ones seen to work headless in a container and as root (`--no-sandbox`) plus `--host-resolver-rules`
that make every host name but 127.0.0.1 fail to resolve, so the browser reaches no other
host even through a link; `open()` also refuses URLs off the site's origin. Each browser
gets a fresh `--user-data-dir`, removed on `close()`. Chromium is a child of this process (same process group), so a rollout killed on
timeout takes it along.
"""

from __future__ import annotations

import shutil
import tempfile
import urllib.parse
from typing import Any

CHROMEDRIVER = "/usr/bin/chromedriver"
CHROME_FLAGS = (
    "--headless=new",
    "--no-sandbox",
    "--disable-gpu",
    "--disable-dev-shm-usage",
    "--disable-background-networking",
    "--disable-component-update",
    "--disable-sync",
    "--no-first-run",
    "--disable-extensions",
    "--window-size=1280,1000",
    "--host-resolver-rules=MAP * ~NOTFOUND, EXCLUDE 127.0.0.1",  # no name resolves: loopback only
)
PAGE_LOAD_TIMEOUT_S = 15
CLICK_NAVIGATION_WAIT_S = 1.0  # a click that has not started navigating by then did not navigate
SUBMIT_NAVIGATION_WAIT_S = 3.0  # a form the browser refused (e.g. min/max) does not navigate


class WebToolError(ValueError):
    """A browser action that failed (no such element, off-site URL): told to the model."""


def browser_problem() -> str | None:
    """Why a browser cannot start here, or None."""
    try:
        import selenium  # noqa: F401
    except ImportError:
        return "selenium is not installed: pip install 'jetctl[browser]'"
    if shutil.which("chromium") is None or shutil.which(CHROMEDRIVER) is None:
        return "chromium or chromedriver missing: apt-get install -y chromium chromium-driver"
    return None


def _short(e: Exception) -> str:
    msg = getattr(e, "msg", None) or str(e)
    return str(msg).strip().splitlines()[0][:300] if str(msg).strip() else type(e).__name__


class Browser:
    """One headless Chromium on one origin; actions return where the browser is now."""

    def __init__(self, origin: str, max_chars: int = 3000) -> None:
        problem = browser_problem()
        if problem:
            raise RuntimeError(problem)
        from selenium import webdriver
        from selenium.webdriver.chrome.service import Service

        self.origin = origin.rstrip("/")
        self.max_chars = max_chars
        self._profile = tempfile.mkdtemp(prefix="jetctl-chrome-")
        options = webdriver.ChromeOptions()
        for flag in CHROME_FLAGS:
            options.add_argument(flag)
        options.add_argument(f"--user-data-dir={self._profile}")
        try:
            self.driver: Any = webdriver.Chrome(service=Service(CHROMEDRIVER), options=options)
        except BaseException:
            shutil.rmtree(self._profile, ignore_errors=True)
            raise
        self.driver.set_page_load_timeout(PAGE_LOAD_TIMEOUT_S)
        self._last_filled: Any = None

    # ------------------------------------------------------------------ helpers

    def where(self) -> str:
        path = urllib.parse.urlsplit(self.driver.current_url)
        here = path.path + (f"?{path.query}" if path.query else "")
        return f"page '{self.driver.title}' at {here}"

    def _resolve(self, url: str) -> str:
        full = urllib.parse.urljoin(self.origin + "/", url)
        parts = urllib.parse.urlsplit(full)
        if f"{parts.scheme}://{parts.netloc}" != self.origin:
            raise WebToolError(
                f"only pages of this site can be opened ({self.origin}), not {url!r}"
            )
        return full

    def _find(self, target: str) -> Any:
        """An element by CSS selector, else a link or button by its (partial) text."""
        from selenium.common.exceptions import InvalidSelectorException, WebDriverException
        from selenium.webdriver.common.by import By

        candidates: list[Any] = []
        try:
            candidates = self.driver.find_elements(By.CSS_SELECTOR, target)
        except InvalidSelectorException:
            candidates = []
        if not candidates:
            candidates = self.driver.find_elements(By.LINK_TEXT, target)
        if not candidates:
            candidates = [
                b
                for b in self.driver.find_elements(
                    By.CSS_SELECTOR, "button, input[type=submit], input[type=button]"
                )
                if target.strip().lower()
                in ((b.text or b.get_attribute("value") or "").strip().lower())
            ]
        if not candidates:
            candidates = self.driver.find_elements(By.PARTIAL_LINK_TEXT, target)
        try:
            shown = [c for c in candidates if c.is_displayed()] or candidates
        except WebDriverException as e:
            raise WebToolError(f"page changed while looking for {target!r}: {_short(e)}") from e
        if not shown:
            raise WebToolError(f"no element matches {target!r} on {self.where()}")
        return shown[0]

    def _page_marker(self) -> Any:
        from selenium.webdriver.common.by import By

        return self.driver.find_element(By.TAG_NAME, "html")

    def _settle(self, old_page: Any, wait_s: float) -> None:
        """Wait (up to wait_s) for a navigation the action started to replace the page, then
        for the new page to finish loading; an action that did not navigate costs wait_s."""
        from selenium.common.exceptions import TimeoutException, WebDriverException
        from selenium.webdriver.support.wait import WebDriverWait

        def replaced(_: Any) -> bool:
            # Chromium reports a node of a replaced document as stale, or (racing the
            # navigation) as "Node with given id does not belong to the document"
            try:
                old_page.is_enabled()
            except WebDriverException:
                return True
            return False

        try:
            WebDriverWait(self.driver, wait_s, poll_frequency=0.05).until(replaced)
        except TimeoutException:
            return  # no navigation: the page stayed
        WebDriverWait(self.driver, PAGE_LOAD_TIMEOUT_S, poll_frequency=0.05).until(
            lambda d: d.execute_script("return document.readyState") == "complete"
        )

    # ------------------------------------------------------------------ actions

    def open(self, url: str) -> str:
        from selenium.common.exceptions import WebDriverException

        try:
            self.driver.get(self._resolve(url))
        except WebDriverException as e:
            raise WebToolError(f"could not open {url!r}: {_short(e)}") from e
        return self.where()

    def click(self, target: str) -> str:
        from selenium.common.exceptions import WebDriverException

        element = self._find(target)
        old_page = self._page_marker()
        try:
            element.click()
            self._settle(old_page, CLICK_NAVIGATION_WAIT_S)
        except WebDriverException as e:
            raise WebToolError(f"could not click {target!r}: {_short(e)}") from e
        return self.where()

    def fill(self, selector: str, text: str) -> str:
        from selenium.common.exceptions import WebDriverException

        element = self._find(selector)
        try:
            element.clear()
            element.send_keys(text)
        except WebDriverException as e:
            raise WebToolError(f"could not fill {selector!r}: {_short(e)}") from e
        self._last_filled = element
        return f"filled {selector!r} on {self.where()}"

    def submit(self, selector: str | None = None) -> str:
        """Submit the form holding `selector` (default: the last filled field)."""
        from selenium.common.exceptions import WebDriverException
        from selenium.webdriver.common.by import By

        element = self._find(selector) if selector else self._last_filled
        if element is None:
            raise WebToolError("nothing to submit: fill a field first or name the form")
        try:
            old_page = self._page_marker()
            form = (
                element
                if element.tag_name == "form"
                else element.find_element(By.XPATH, "./ancestor::form")
            )
            buttons = form.find_elements(By.CSS_SELECTOR, "button[type=submit], input[type=submit]")
            if buttons:
                buttons[0].click()
            else:
                form.submit()
            self._settle(old_page, SUBMIT_NAVIGATION_WAIT_S)
        except WebDriverException as e:
            raise WebToolError(f"could not submit: {_short(e)}") from e
        self._last_filled = None
        return self.where()

    def read(self) -> str:
        """The page's visible text, whitespace squeezed, at most max_chars."""
        from selenium.webdriver.common.by import By

        text = self.driver.find_element(By.TAG_NAME, "body").text
        lines = [" ".join(line.split()) for line in text.splitlines()]
        squeezed = "\n".join(line for line in lines if line)
        if len(squeezed) > self.max_chars:
            squeezed = squeezed[: self.max_chars] + "\n[...]"
        return f"{self.where()}\n{squeezed}"

    def links(self) -> str:
        """The page's visible links as `text -> path`, one a line."""
        from selenium.webdriver.common.by import By

        rows = []
        for a in self.driver.find_elements(By.TAG_NAME, "a"):
            if a.is_displayed():
                href = urllib.parse.urlsplit(a.get_attribute("href") or "")
                path = href.path + (f"?{href.query}" if href.query else "")
                rows.append(f"{a.text.strip()} -> {path}")
        return "\n".join(rows)[: self.max_chars]

    def close(self) -> None:
        try:
            self.driver.quit()
        finally:
            shutil.rmtree(self._profile, ignore_errors=True)
