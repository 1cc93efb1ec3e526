"""The shop the web env serves itself: stdlib http.server in a thread on 127.0.0.1.

Pages (plain HTML, no JavaScript):
    /                       home: search form, category links, link to the cart
    /products?page=N        all products, PAGE_SIZE per page, "Next" / "Previous" links
    /category/<c>?page=N    one category, same pagination
    /search?q=...&page=N    products whose name contains every word of q
    /product/<slug>         name, category, price, description, a form
                            (quantity input `#qty`, button "Add to cart") posting /cart/add
    /cart                   the cart, each line with a "Remove" button (POST /cart/remove)

With `quick_add` (the easy level) every listed product also has its own button, "Add
<product name>", that puts one in the cart (POST /cart/add, as the product page's form does);
`page_size` sets how many products a listing page shows (PAGE_SIZE; the easy level, 3).

The cart is the site's state (`Shop.cart`, product slug -> quantity) and is what the env
scores. The catalogue is a pure function of `catalog_seed`.
Left out: accounts, checkout, JavaScript-driven pages.
"""

from __future__ import annotations

import html
import random
import threading
import urllib.parse
from dataclasses import dataclass
from http.server import BaseHTTPRequestHandler
from typing import Any

from jetctl.env import LocalHTTPServer

PAGE_SIZE = 5
ADJECTIVES = ("Blue", "Red", "Steel", "Oak", "Compact", "Deluxe", "Travel", "Classic")
NOUNS = {
    "kitchen": ("Kettle", "Teapot", "Skillet", "Blender", "Toaster"),
    "garden": ("Trowel", "Watering Can", "Planter", "Hose Reel", "Rake"),
    "office": ("Desk Lamp", "Stapler", "Notebook", "Pen Set", "Monitor Stand"),
    "outdoor": ("Tent", "Lantern", "Backpack", "Camp Chair", "Cooler"),
}
MAX_QTY = 99


@dataclass(frozen=True)
class Product:
    slug: str
    name: str
    category: str
    price_cents: int
    description: str

    @property
    def price(self) -> str:
        return f"${self.price_cents / 100:.2f}"


def make_catalog(seed: int, per_category: int = 7) -> list[Product]:
    """`per_category` distinct products in each category; names, prices from `seed`."""
    rng = random.Random(seed)
    products = []
    prices: set[int] = set()  # distinct, so "the cheapest in a category" is one product
    for category, nouns in NOUNS.items():
        names = sorted({f"{a} {n}" for a in ADJECTIVES for n in nouns})
        for name in rng.sample(names, per_category):
            slug = name.lower().replace(" ", "-")
            price = rng.randrange(5, 200) * 100 + rng.choice((0, 49, 99))
            while price in prices:
                price = rng.randrange(5, 200) * 100 + rng.choice((0, 49, 99))
            prices.add(price)
            products.append(
                Product(
                    slug=slug,
                    name=name,
                    category=category,
                    price_cents=price,
                    description=f"A {name.lower()} for your {category} needs.",
                )
            )
    products.sort(key=lambda p: p.slug)
    return products


class Shop:
    """Catalogue + cart, safe to use from the server's threads."""

    def __init__(self, catalog: list[Product]) -> None:
        self.catalog = catalog
        self.by_slug = {p.slug: p for p in catalog}
        self._cart: dict[str, int] = {}
        self._lock = threading.Lock()
        self.requests = 0

    @property
    def cart(self) -> dict[str, int]:
        with self._lock:
            return dict(self._cart)

    def add(self, slug: str, qty: int) -> None:
        with self._lock:
            self._cart[slug] = min(MAX_QTY, self._cart.get(slug, 0) + qty)

    def remove(self, slug: str) -> None:
        with self._lock:
            self._cart.pop(slug, None)

    def search(self, query: str) -> list[Product]:
        words = query.lower().split()
        return [p for p in self.catalog if words and all(w in p.name.lower() for w in words)]


def _page(title: str, body: str) -> bytes:
    doc = (
        "<!doctype html><html><head><meta charset='utf-8'>"
        f"<title>{html.escape(title)}</title></head><body>"
        "<nav><a href='/'>Home</a> | <a href='/products'>All products</a> | "
        "<a href='/cart' id='cart-link'>Cart</a></nav>"
        f"<h1>{html.escape(title)}</h1>{body}</body></html>"
    )
    return doc.encode()


def _quick_add(p: Product) -> str:
    return (
        "<form class='quick-add' action='/cart/add' method='post' style='display:inline'>"
        f"<input type='hidden' name='slug' value='{p.slug}'><input type='hidden' name='qty' "
        f"value='1'><button type='submit'>Add {html.escape(p.name)}</button></form>"
    )


def page_of(products: list[Product], product: Product, page_size: int = PAGE_SIZE) -> int:
    """The listing page (1-based) that shows `product`."""
    return products.index(product) // page_size + 1


def _listing(
    products: list[Product], page: int, base: str, quick_add: bool = False,
    page_size: int = PAGE_SIZE,
) -> str:  # fmt: skip
    pages = max(1, -(-len(products) // page_size))
    page = min(max(page, 1), pages)
    chunk = products[(page - 1) * page_size : page * page_size]
    items = "".join(
        f"<li class='product'><a href='/product/{p.slug}'>{html.escape(p.name)}</a> "
        f"<span class='price'>{p.price}</span>{' ' + _quick_add(p) if quick_add else ''}</li>"
        for p in chunk
    )
    sep = "&" if "?" in base else "?"
    nav = []
    if page > 1:
        nav.append(f"<a href='{base}{sep}page={page - 1}' rel='prev'>Previous</a>")
    nav.append(f"<span>Page {page} of {pages}</span>")
    if page < pages:
        nav.append(f"<a href='{base}{sep}page={page + 1}' rel='next'>Next</a>")
    empty = "" if products else "<p>No products found.</p>"
    return f"{empty}<ul id='products'>{items}</ul><p class='pages'>{' '.join(nav)}</p>"


class _Handler(BaseHTTPRequestHandler):
    shop: Shop  # set on the per-server subclass
    quick_add: bool  # likewise
    page_size: int  # likewise

    def log_message(self, format: str, *args: Any) -> None:  # stdlib's name
        pass  # a rollout's stderr is not the place for access logs

    def _send(self, status: int, body: bytes, headers: dict[str, str] | None = None) -> None:
        self.send_response(status)
        self.send_header("Content-Type", "text/html; charset=utf-8")
        self.send_header("Content-Length", str(len(body)))
        for k, v in (headers or {}).items():
            self.send_header(k, v)
        self.end_headers()
        self.wfile.write(body)

    def _redirect(self, location: str) -> None:
        self._send(303, b"", {"Location": location})

    def _not_found(self) -> None:
        self._send(404, _page("Not found", "<p>No such page.</p>"))

    def _listing(self, products: list[Product], page: int, base: str) -> str:
        return _listing(products, page, base, self.quick_add, self.page_size)

    def do_GET(self) -> None:  # http.server's name
        self.shop.requests += 1
        url = urllib.parse.urlsplit(self.path)
        query = urllib.parse.parse_qs(url.query)
        page = _int(query.get("page", ["1"])[0], 1)
        parts = [urllib.parse.unquote(p) for p in url.path.split("/") if p]
        shop = self.shop
        if not parts:
            cats = "".join(
                f"<li><a href='/category/{c}'>{c.title()}</a></li>" for c in sorted(NOUNS)
            )
            body = (
                "<form id='search' action='/search' method='get'>"
                "<input type='text' name='q' id='q' placeholder='Search products'>"
                "<button type='submit' id='search-button'>Search</button></form>"
                f"<h2>Categories</h2><ul id='categories'>{cats}</ul>"
            )
            self._send(200, _page("Shop", body))
        elif parts == ["products"]:
            self._send(200, _page("All products", self._listing(shop.catalog, page, "/products")))
        elif len(parts) == 2 and parts[0] == "category" and parts[1] in NOUNS:
            items = [p for p in shop.catalog if p.category == parts[1]]
            self._send(200, _page(parts[1].title(), self._listing(items, page, f"/category/{parts[1]}")))
        elif parts == ["search"]:
            q = query.get("q", [""])[0]
            base = "/search?" + urllib.parse.urlencode({"q": q})
            self._send(200, _page(f"Search: {q}", self._listing(shop.search(q), page, base)))
        elif len(parts) == 2 and parts[0] == "product" and parts[1] in shop.by_slug:
            p = shop.by_slug[parts[1]]
            body = (
                f"<p class='category'>Category: {p.category.title()}</p>"
                f"<p class='price' id='price'>{p.price}</p><p>{html.escape(p.description)}</p>"
                "<form id='add-to-cart' action='/cart/add' method='post'>"
                f"<input type='hidden' name='slug' value='{p.slug}'>"
                "<label for='qty'>Quantity</label>"
                "<input type='number' name='qty' id='qty' value='1' min='1' max='99'>"
                "<button type='submit' id='add'>Add to cart</button></form>"
            )
            self._send(200, _page(p.name, body))
        elif parts == ["cart"]:
            cart = shop.cart
            rows = "".join(
                f"<li class='line'>{html.escape(shop.by_slug[s].name)} x {q} "
                "<form action='/cart/remove' method='post' style='display:inline'>"
                f"<input type='hidden' name='slug' value='{s}'>"
                "<button type='submit'>Remove</button></form></li>"
                for s, q in sorted(cart.items())
            )
            body = f"<ul id='cart'>{rows}</ul>" if cart else "<p>Your cart is empty.</p>"
            self._send(200, _page("Cart", body))
        else:
            self._not_found()

    def do_POST(self) -> None:  # http.server's name
        self.shop.requests += 1
        length = min(_int(self.headers.get("Content-Length", "0"), 0), 10_000)
        form = urllib.parse.parse_qs(self.rfile.read(length).decode(errors="replace"))
        slug = form.get("slug", [""])[0]
        if slug not in self.shop.by_slug:
            self._send(400, _page("Bad request", "<p>Unknown product.</p>"))
        elif self.path == "/cart/add":
            qty = _int(form.get("qty", ["1"])[0], 0)
            if not 1 <= qty <= MAX_QTY:
                self._send(400, _page("Bad request", f"<p>Quantity must be 1-{MAX_QTY}.</p>"))
                return
            self.shop.add(slug, qty)
            self._redirect("/cart")
        elif self.path == "/cart/remove":
            self.shop.remove(slug)
            self._redirect("/cart")
        else:
            self._not_found()


def _int(text: str, default: int) -> int:
    try:
        return int(text)
    except ValueError:
        return default


class ShopServer(LocalHTTPServer):
    """A Shop served on 127.0.0.1 (free port) from a daemon thread; `close()` stops it."""

    def __init__(self, shop: Shop, quick_add: bool = False, page_size: int = PAGE_SIZE) -> None:
        self.shop = shop
        handler = type(
            "ShopHandler",
            (_Handler,),
            {"shop": shop, "quick_add": quick_add, "page_size": page_size},
        )
        super().__init__(handler, "web-shop")
