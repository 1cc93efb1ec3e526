"""WebEnv / WebSession (see the package docstring for the tasks, levels and reward)."""

from __future__ import annotations

import random
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

from envs.levels import (
    ActionLog,
    Level,
    LevelledSession,
    check_level,
    easy_reward,
    example_call,
)
from envs.web.browser import Browser, WebToolError
from envs.web.site import NOUNS, PAGE_SIZE, Product, Shop, ShopServer, make_catalog, page_of
from jetctl.env import Task

TASK_KINDS = ("add", "add_qty", "cheapest")
REWARD_EXACT = 1.0
REWARD_TARGET_IN_CART = 0.5  # the right product is in the cart, with a wrong quantity or company

HARD_SYSTEM = (
    "You operate a web browser on a shop website whose home page is {url}. Use the tools to "
    "look around and act; read() shows the current page's text and links() its links. "
    "When the task is done, reply briefly without calling a tool."
)
EASY_SYSTEM = "You operate a web browser on a shop website."
EASY_PROMPT = "Add one {name} to the cart. Call click.\n\nThe browser shows:\n{page}"
# The easy level's prior exchange: a task on another page of the same catalogue, and the call
# that does it (its page text is what read() shows there; a test checks it).
EXAMPLE_PRODUCT = 0  # index into the catalogue; never asked as an easy task
EASY_PAGE_SIZE = 3  # products per listing page at the easy level: a short page to read
TOOLS_BY_LEVEL: dict[Level, tuple[str, ...]] = {
    "easy": ("click",),
    "hard": ("open", "click", "fill", "submit", "read", "links"),
}
MAX_STEPS_BY_LEVEL: dict[Level, int] = {"easy": 1, "hard": 20}


def start_page(catalog: list[Product], product: Product) -> str:
    """The easy level's first page: the listing page of `product`'s category showing it."""
    in_category = [p for p in catalog if p.category == product.category]
    page = page_of(in_category, product, EASY_PAGE_SIZE)
    return f"/category/{product.category}" + (f"?page={page}" if page > 1 else "")


@dataclass
class WebSession(LevelledSession):
    """One rollout: its own shop server and (on first use) its own headless browser."""

    tools_by_level = TOOLS_BY_LEVEL
    max_steps_by_level = MAX_STEPS_BY_LEVEL

    task: Task
    server: ShopServer
    max_chars: int = 3000
    level: Level = "hard"
    example: tuple[dict[str, Any], ...] = ()  # the easy level's prior exchange
    log_actions: bool = False
    _browser: Browser | None = field(default=None, repr=False)
    closed: bool = False

    def __post_init__(self) -> None:
        self.actions = ActionLog("web", self.level, self.task.id)

    @property
    def url(self) -> str:
        """The site's home page."""
        return self.server.base_url + "/"

    @property
    def browser(self) -> Browser:
        if self._browser is None:
            self._browser = Browser(self.server.base_url, max_chars=self.max_chars)
        return self._browser

    def opening(self) -> list[dict[str, Any]]:
        """The conversation the agent starts from. Easy: the browser opens the task's start
        page first, and the task comes with the page's text after the prior exchange."""
        if self.level == "hard":
            return [
                {"role": "system", "content": HARD_SYSTEM.format(url=self.url)},
                {"role": "user", "content": self.task.prompt},
            ]
        self.browser.open(self.task.data["start"])
        task = EASY_PROMPT.format(name=self.task.data["name"], page=page_text(self.browser.read()))
        return [
            {"role": "system", "content": EASY_SYSTEM},
            *self.example,
            {"role": "user", "content": task},
        ]

    # ------------------------------------------------------------------ tools

    def _act(self, tool: str, args: dict[str, Any], result: str) -> str:
        self.actions.record(tool, args, result)
        return result

    def _refused(self, tool: str, args: dict[str, Any], e: Exception) -> None:
        self.actions.record(tool, args, f"error: {e}")

    def open(self, url: str) -> str:
        """Open a page of the site: a path like '/cart' or a full URL on the site."""
        try:
            return self._act("open", {"url": url}, self.browser.open(url))
        except WebToolError as e:
            self._refused("open", {"url": url}, e)
            raise

    def click(self, target: str) -> str:
        """Click an element: a CSS selector, or a link's or button's text."""
        try:
            return self._act("click", {"target": target}, self.browser.click(target))
        except WebToolError as e:
            self._refused("click", {"target": target}, e)
            raise

    def fill(self, selector: str, text: str) -> str:
        """Type `text` into the field matching a CSS selector (its old value is cleared)."""
        args = {"selector": selector, "text": text}
        try:
            return self._act("fill", args, self.browser.fill(selector, text))
        except WebToolError as e:
            self._refused("fill", args, e)
            raise

    def submit(self, selector: str | None = None) -> str:
        """Submit the form of `selector`, or of the last filled field."""
        try:
            return self._act("submit", {"selector": selector}, self.browser.submit(selector))
        except WebToolError as e:
            self._refused("submit", {"selector": selector}, e)
            raise

    def read(self) -> str:
        """The visible text of the current page (trimmed)."""
        return self._act("read", {}, self.browser.read())

    def links(self) -> str:
        """The current page's links as `text -> path`."""
        return self._act("links", {}, self.browser.links())

    # ------------------------------------------------------------------ scoring

    def task_score(self) -> float:
        """From the server's cart: 1.0 exactly the goal, 0.5 the target among others or with
        a wrong quantity, 0.0 otherwise."""
        cart = self.server.shop.cart
        slug, qty = self.task.data["slug"], int(self.task.data["qty"])
        if cart == {slug: qty}:
            return REWARD_EXACT
        if slug in cart:
            return REWARD_TARGET_IN_CART
        return 0.0

    def reward(self) -> float:
        """Hard: the task score. Easy: 0.2 for a well-formed action + 0.8 * the task score."""
        if self.level == "hard":
            return self.task_score()
        return easy_reward(self.task_score(), self.actions.well_formed, self.max_steps)

    def close(self) -> None:
        if self.closed:
            return
        self.closed = True
        try:
            if self.log_actions:
                self.actions.dump(self.reward())
            if self._browser is not None:
                self._browser.close()
        finally:
            self.server.close()


def page_text(read: str) -> str:
    """`Browser.read()` without its first line (the page's title and path)."""
    return read.split("\n", 1)[1] if "\n" in read else ""


@dataclass
class WebEnv:
    """Shop tasks over a catalogue fixed by `catalog_seed`; ids are `web-<kind>-<slug>-<qty>`
    (hard) or `web-easy-<slug>` (easy)."""

    catalog_seed: int = 0
    max_chars: int = 3000
    level: Level = "hard"
    log_actions: bool = False
    name: str = "web"
    catalog: list[Product] = field(init=False, repr=False)

    def __post_init__(self) -> None:
        if self.max_chars < 200:
            raise ValueError(f"max_chars ({self.max_chars}) must be at least 200")
        self.level = check_level(self.level)
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

    def easy_task(self, product: Product) -> Task:
        """Add one `product` from the listing page that shows it (its quick-add button)."""
        if product == self.catalog[EXAMPLE_PRODUCT]:
            raise ValueError(f"{product.name} is the easy level's example, never a task")
        return Task(
            id=f"web-easy-{product.slug}",
            prompt=f"Add one {product.name} to the cart.",
            data={"kind": "add", "slug": product.slug, "qty": 1, "name": product.name,
                  "start": start_page(self.catalog, product), "catalog_seed": self.catalog_seed},
        )  # fmt: skip

    def example(self) -> tuple[dict[str, Any], ...]:
        """The easy level's prior exchange: a task on another page, and the call that does it."""
        product = self.catalog[EXAMPLE_PRODUCT]
        page = listing_text(self.catalog, product)
        return (
            {"role": "user", "content": EASY_PROMPT.format(name=product.name, page=page)},
            example_call("click", target=f"Add {product.name}"),
        )

    def cheapest(self, category: str) -> Product:
        return min((p for p in self.catalog if p.category == category), key=lambda p: p.price_cents)

    def tasks(self, rng: random.Random) -> Iterator[Task]:
        if self.level == "easy":
            products = [p for i, p in enumerate(self.catalog) if i != EXAMPLE_PRODUCT]
            while True:
                yield self.easy_task(rng.choice(products))
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
        easy = self.level == "easy"
        if easy != ("start" in task.data):
            raise ValueError(f"task {task.id} is not a task of the {self.level} level")
        server = ShopServer(Shop(self.catalog), quick_add=easy,
                            page_size=EASY_PAGE_SIZE if easy else PAGE_SIZE)  # fmt: skip
        return WebSession(
            task, server, max_chars=self.max_chars, level=self.level,
            example=self.example() if easy else (), log_actions=self.log_actions,
        )  # fmt: skip


def listing_text(catalog: list[Product], product: Product) -> str:
    """What the browser reads (title line aside) on the easy start page of `product`."""
    in_category = [p for p in catalog if p.category == product.category]
    page = page_of(in_category, product, EASY_PAGE_SIZE)
    pages = -(-len(in_category) // EASY_PAGE_SIZE)
    shown = in_category[(page - 1) * EASY_PAGE_SIZE : page * EASY_PAGE_SIZE]
    nav = (["Previous"] if page > 1 else []) + [f"Page {page} of {pages}"]
    nav += ["Next"] if page < pages else []
    return "\n".join(
        ["Home | All products | Cart", product.category.title()]
        + [f"{p.name} {p.price} Add {p.name}" for p in shown]
        + [" ".join(nav)]
    )


def make_env(
    catalog_seed: int = 0, max_chars: int = 3000, level: Level = "hard", log_actions: bool = False
) -> WebEnv:
    """The web env (see the package docstring)."""
    return WebEnv(catalog_seed=catalog_seed, max_chars=max_chars, level=level,
                  log_actions=log_actions)  # fmt: skip
