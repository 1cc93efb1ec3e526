"""WebEnv / WebSession (see the package docstring for the tasks and reward)."""

from __future__ import annotations

import random
from collections.abc import Iterator
from dataclasses import dataclass, field

from envs.web.browser import Browser
from envs.web.site import NOUNS, Product, Shop, ShopServer, make_catalog
from jetctl.env import Task

TASK_KINDS = ("add", "add_qty", "cheapest")
REWARD_EXACT = 1.0
REWARD_TARGET_IN_CART = 0.5  # the right product is in the cart, with a wrong quantity or company


@dataclass
class WebSession:
    """One rollout: its own shop server and (on first use) its own headless browser."""

    task: Task
    server: ShopServer
    max_chars: int = 3000
    _browser: Browser | None = field(default=None, repr=False)
    closed: bool = False

    @property
    def url(self) -> str:
        """The site's home page."""
        return self.server.base_url + "/"

    @property
    def browser(self) -> Browser:
        if self._browser is None:
            self._browser = Browser(self.server.base_url, max_chars=self.max_chars)
        return self._browser

    # ------------------------------------------------------------------ tools

    def open(self, url: str) -> str:
        """Open a page of the site: a path like '/cart' or a full URL on the site."""
        return self.browser.open(url)

    def click(self, target: str) -> str:
        """Click an element: a CSS selector, or a link's or button's text."""
        return self.browser.click(target)

    def fill(self, selector: str, text: str) -> str:
        """Type `text` into the field matching a CSS selector (its old value is cleared)."""
        return self.browser.fill(selector, text)

    def submit(self, selector: str | None = None) -> str:
        """Submit the form of `selector`, or of the last filled field."""
        return self.browser.submit(selector)

    def read(self) -> str:
        """The visible text of the current page (trimmed)."""
        return self.browser.read()

    def links(self) -> str:
        """The current page's links as `text -> path`."""
        return self.browser.links()

    # ------------------------------------------------------------------ scoring

    def reward(self) -> float:
        """From the server's cart: 1.0 exactly the goal, 0.5 the target among others or with
        a wrong quantity, 0.0 otherwise."""
        cart = self.server.shop.cart
        slug, qty = self.task.data["slug"], int(self.task.data["qty"])
        if cart == {slug: qty}:
            return REWARD_EXACT
        if slug in cart:
            return REWARD_TARGET_IN_CART
        return 0.0

    def close(self) -> None:
        if self.closed:
            return
        self.closed = True
        try:
            if self._browser is not None:
                self._browser.close()
        finally:
            self.server.close()


@dataclass
class WebEnv:
    """Shop tasks over a catalogue fixed by `catalog_seed`; ids are `web-<kind>-<slug>-<qty>`."""

    catalog_seed: int = 0
    max_chars: int = 3000
    name: str = "web"
    catalog: list[Product] = field(init=False, repr=False)

    def __post_init__(self) -> None:
        if self.max_chars < 200:
            raise ValueError(f"max_chars ({self.max_chars}) must be at least 200")
        self.catalog = make_catalog(self.catalog_seed)

    def task(self, kind: str, product: Product, qty: int = 1) -> Task:
        if kind == "add":
            prompt = f"Find the product '{product.name}' in the shop and add one to the cart."
        elif kind == "add_qty":
            prompt = f"Add {qty} of the product '{product.name}' to the shopping cart."
        elif kind == "cheapest":
            prompt = (
                f"Add one of the cheapest product in the '{product.category.title()}' category "
                "to the shopping cart."
            )
        else:
            raise ValueError(f"kind ({kind!r}) must be one of {', '.join(TASK_KINDS)}")
        return Task(
            id=f"web-{kind}-{product.slug}-{qty}",
            prompt=prompt + " Nothing else should end up in the cart.",
            data={"kind": kind, "slug": product.slug, "qty": qty,
                  "catalog_seed": self.catalog_seed},
        )  # fmt: skip

    def cheapest(self, category: str) -> Product:
        return min((p for p in self.catalog if p.category == category), key=lambda p: p.price_cents)

    def tasks(self, rng: random.Random) -> Iterator[Task]:
        while True:
            kind = rng.choice(TASK_KINDS)
            if kind == "cheapest":
                yield self.task(kind, self.cheapest(rng.choice(sorted(NOUNS))))
            elif kind == "add_qty":
                yield self.task(kind, rng.choice(self.catalog), rng.randint(2, 5))
            else:
                yield self.task(kind, rng.choice(self.catalog))

    def open(self, task: Task) -> WebSession:
        if task.data["catalog_seed"] != self.catalog_seed:
            raise ValueError(
                f"task {task.id} was made for catalog_seed={task.data['catalog_seed']}, "
                f"this env has catalog_seed={self.catalog_seed}"
            )
        server = ShopServer(Shop(self.catalog))
        return WebSession(task, server, max_chars=self.max_chars)


def make_env(catalog_seed: int = 0, max_chars: int = 3000) -> WebEnv:
    """The web env (see the package docstring)."""
    return WebEnv(catalog_seed=catalog_seed, max_chars=max_chars)
