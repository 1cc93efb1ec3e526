"""Shop on a real website through a real browser: find a product and put it in the cart.

Each session serves its own small shop (`envs/web/site.py`: stdlib http.server in a thread
on 127.0.0.1, a free port; home with search, category pages and a full listing with
pagination, product pages with a quantity field and an "Add to cart" form, the cart) and
drives it with headless Chromium through Selenium (`envs/web/browser.py`; started on the
first browser tool call). Session tools, each returning text for the model:

    open(url)            a path ('/cart') or a full URL on the site; other origins refused
    click(target)        a CSS selector, or a link's or button's text
    fill(selector, text) type into a field
    submit(selector?)    submit the form of `selector` or of the last filled field
    read()               the page's visible text, trimmed to max_chars
    links()              the page's links as `text -> path`

`session.url` is the home page. Levels (`level`, envs/levels.py):

* `hard` (default): every tool above, 20 model calls, from the home page. Tasks (`kind`):
  `add` one named product, `add_qty` N of a named product, `cheapest` one of the cheapest
  product of a category (needs browsing the category's pages).
* `easy`: one `click`. The browser opens the listing page (category, page) that shows the
  task's product, and the site gives every listed product its own "Add <name>" button. The
  conversation is a prior exchange (another product's task on its page, and the click that
  adds it), then "Add one <name> to the cart." with the page's text as the browser reads it.

Task score, from the server's cart, not from what the browser shows: 1.0 the cart is
exactly the goal, 0.5 the target product is in it with a wrong quantity or with other
products, 0.0 otherwise. Reward: hard, the task score; easy, 0.2 for a well-formed click +
0.8 * the task score. `log_actions=True` prints each session's actions (envs/levels.py).

Needs `apt-get install -y chromium chromium-driver` and `pip install 'jetctl[browser]'`.
Run: `make_env(catalog_seed=0, max_chars=3000, level="hard", log_actions=False)`, agent
`agents.web:agent` (it takes the session's tools, opening and step budget).
Left out: JavaScript-driven pages, logins and checkout, screenshots for vision models.
"""

from __future__ import annotations

from envs.web.browser import Browser, WebToolError, browser_problem
from envs.web.env import WebEnv, WebSession, make_env
from envs.web.site import Product, Shop, ShopServer, make_catalog

__all__ = [
    "Browser",
    "Product",
    "Shop",
    "ShopServer",
    "WebEnv",
    "WebSession",
    "WebToolError",
    "browser_problem",
    "make_catalog",
    "make_env",
]
