"""The api env's REST service: stdlib http.server in a thread on 127.0.0.1, JSON in and out.

Every request needs `Authorization: Bearer <api key>` (401 otherwise). A token bucket per
service (`burst` requests, refilled at `rate_per_s`) answers excess requests with 429, a
`Retry-After` header in whole seconds and `{"error": ..., "retry_after": s}`; a request that
comes back before its Retry-After has passed is counted in `early_retries`.

    GET  /v1/users?name=<part of the name>   {"users": [{"id", "name"}]}
    GET  /v1/users/<id>                      {"id", "name", "email"}
    GET  /v1/users/<id>/orders?page=N        {"orders": [{"id", "status", "date"}],
                                              "page": N, "next_page": N+1 | null}
    GET  /v1/orders/<id>                     {"id", "user_id", "status", "date",
                                              "items": [{"product", "qty", "unit_price_cents"}]}
    POST /v1/answers {"task_id", "answer"}   the first answer per task is kept (409 after)

The data is a pure function of `seed`. Requests are logged (method, path, status) at DEBUG
on the `envs.api` logger; headers never are, and no response echoes the credential.
"""

from __future__ import annotations

import hmac
import json
import logging
import math
import random
import threading
import time
import urllib.parse
from dataclasses import dataclass
from http.server import BaseHTTPRequestHandler
from typing import Any

from jetctl.env import LocalHTTPServer

log = logging.getLogger("envs.api")

FIRST = ("Ada", "Brook", "Cyrus", "Dana", "Emil", "Farah", "Gus", "Hana", "Ivo", "June")
LAST = ("Okafor", "Lindqvist", "Moreau", "Tanaka", "Reyes", "Novak", "Haddad", "Quinn")
PRODUCTS = {
    "Widget": 1250,
    "Gadget": 3999,
    "Sprocket": 475,
    "Flange": 860,
    "Gizmo": 2200,
    "Doohickey": 1575,
}
STATUSES = ("shipped", "shipped", "pending", "cancelled")
ORDERS_PAGE_SIZE = 3


class Secret:
    """A credential that never shows itself in repr, str, logs or tracebacks."""

    __slots__ = ("_value",)

    def __init__(self, value: str) -> None:
        self._value = value

    def reveal(self) -> str:
        return self._value

    def __repr__(self) -> str:
        return "Secret('***')"

    __str__ = __repr__

    def __reduce__(self) -> Any:
        raise TypeError("a Secret is not pickled; pass the plain value through env_args")


@dataclass(frozen=True)
class Item:
    product: str
    qty: int
    unit_price_cents: int


@dataclass(frozen=True)
class Order:
    id: str
    user_id: str
    status: str
    date: str
    items: tuple[Item, ...]

    @property
    def total_cents(self) -> int:
        return sum(i.qty * i.unit_price_cents for i in self.items)


@dataclass(frozen=True)
class User:
    id: str
    name: str
    email: str


@dataclass(frozen=True)
class Dataset:
    users: tuple[User, ...]
    orders: tuple[Order, ...]

    def orders_of(self, user_id: str) -> list[Order]:
        return [o for o in self.orders if o.user_id == user_id]


def make_dataset(seed: int, n_users: int = 12) -> Dataset:
    """Users with distinct names and 2-7 orders each; a pure function of `seed`."""
    rng = random.Random(seed)
    names = rng.sample([f"{f} {last}" for f in FIRST for last in LAST], n_users)
    users: list[User] = []
    orders: list[Order] = []
    for u, name in enumerate(names, start=1):
        user = User(f"u{100 + u}", name, name.lower().replace(" ", ".") + "@example.com")
        users.append(user)
        for _ in range(rng.randint(2, 7)):
            items = tuple(
                Item(p, rng.randint(1, 4), PRODUCTS[p])
                for p in rng.sample(sorted(PRODUCTS), rng.randint(1, 3))
            )
            orders.append(
                Order(
                    id=f"o{1000 + len(orders)}",
                    user_id=user.id,
                    status=rng.choice(STATUSES),
                    date=f"2026-{rng.randint(1, 12):02d}-{rng.randint(1, 28):02d}",
                    items=items,
                )
            )
    return Dataset(tuple(users), tuple(orders))


def order_json(order: Order) -> dict[str, Any]:
    """GET /v1/orders/<id>'s body."""
    return {
        "id": order.id,
        "user_id": order.user_id,
        "status": order.status,
        "date": order.date,
        "items": [
            {"product": i.product, "qty": i.qty, "unit_price_cents": i.unit_price_cents}
            for i in order.items
        ],
    }


class RateLimiter:
    """Token bucket: `burst` requests at once, refilled at `rate_per_s`."""

    def __init__(self, rate_per_s: float, burst: int) -> None:
        if rate_per_s <= 0 or burst < 1:
            raise ValueError(f"need rate_per_s > 0 and burst >= 1, got {rate_per_s}, {burst}")
        self.rate, self.burst = rate_per_s, burst
        self._tokens = float(burst)
        self._t = time.monotonic()
        self._retry_at = 0.0  # when the last 429 said to come back
        self._lock = threading.Lock()
        self.limited = 0  # 429s answered
        self.early_retries = 0  # requests that came before their Retry-After had passed

    def take(self) -> int:
        """0 if the request may go ahead, else the Retry-After seconds to answer."""
        with self._lock:
            now = time.monotonic()
            if now < self._retry_at:
                self.early_retries += 1
            self._tokens = min(self.burst, self._tokens + (now - self._t) * self.rate)
            self._t = now
            if self._tokens >= 1:
                self._tokens -= 1
                return 0
            wait = max(1, math.ceil((1 - self._tokens) / self.rate))
            self._retry_at = now + wait
            self.limited += 1
            return wait


class ApiState:
    """Dataset, credential, limiter and submitted answers of one service."""

    def __init__(self, data: Dataset, api_key: Secret, limiter: RateLimiter) -> None:
        self.data = data
        self.api_key = api_key
        self.limiter = limiter
        self.answers: dict[str, Any] = {}
        self.served: list[tuple[str, str, int]] = []  # (method, path without query, status)
        self.unauthorized = 0
        self.requests = 0
        self._lock = threading.Lock()

    def submit(self, task_id: str, answer: Any) -> bool:
        with self._lock:
            if task_id in self.answers:
                return False
            self.answers[task_id] = answer
            return True


class _Handler(BaseHTTPRequestHandler):
    state: ApiState  # set on the per-server subclass

    def log_message(self, format: str, *args: Any) -> None:  # stdlib's name
        pass  # the request line goes to `log` below, without headers

    def _send(
        self, status: int, body: dict[str, Any], headers: dict[str, str] | None = None
    ) -> None:
        data = json.dumps(body).encode()
        path = urllib.parse.urlsplit(self.path).path
        # recorded before the reply goes out: a caller that has its reply finds it recorded
        self.state.served.append((self.command, path, status))
        self.send_response(status)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        for k, v in (headers or {}).items():
            self.send_header(k, v)
        self.end_headers()
        self.wfile.write(data)
        log.debug("%s %s -> %d", self.command, path, status)

    def _authorized(self) -> bool:
        given = self.headers.get("Authorization", "")
        expected = "Bearer " + self.state.api_key.reveal()
        return hmac.compare_digest(given.encode(), expected.encode())

    def _admit(self) -> bool:
        """Auth, then the rate limit; answers the refusal itself."""
        self.state.requests += 1
        if not self._authorized():
            self.state.unauthorized += 1
            self._send(
                401,
                {"error": "missing or invalid credentials"},
                {"WWW-Authenticate": 'Bearer realm="api"'},
            )
            return False
        wait = self.state.limiter.take()
        if wait:
            self._send(
                429,
                {"error": "rate limited", "retry_after": wait},
                {"Retry-After": str(wait)},
            )
            return False
        return True

    def do_GET(self) -> None:  # http.server's name
        if not self._admit():
            return
        url = urllib.parse.urlsplit(self.path)
        query = urllib.parse.parse_qs(url.query)
        parts = [p for p in url.path.split("/") if p]
        data = self.state.data
        users = {u.id: u for u in data.users}
        if parts == ["v1", "users"]:
            needle = query.get("name", [""])[0].strip().lower()
            found = [u for u in data.users if needle and needle in u.name.lower()]
            self._send(200, {"users": [{"id": u.id, "name": u.name} for u in found]})
        elif len(parts) == 3 and parts[:2] == ["v1", "users"] and parts[2] in users:
            u = users[parts[2]]
            self._send(200, {"id": u.id, "name": u.name, "email": u.email})
        elif len(parts) == 4 and parts[:2] == ["v1", "users"] and parts[3] == "orders":
            if parts[2] not in users:
                self._send(404, {"error": f"no user {parts[2]}"})
                return
            orders = data.orders_of(parts[2])
            try:
                page = int(query.get("page", ["1"])[0])
            except ValueError:
                self._send(400, {"error": "page must be an integer"})
                return
            pages = max(1, -(-len(orders) // ORDERS_PAGE_SIZE))
            chunk = (
                orders[(page - 1) * ORDERS_PAGE_SIZE : page * ORDERS_PAGE_SIZE] if page > 0 else []
            )
            self._send(
                200,
                {
                    "orders": [{"id": o.id, "status": o.status, "date": o.date} for o in chunk],
                    "page": page,
                    "next_page": page + 1 if 0 < page < pages else None,
                },
            )
        elif len(parts) == 3 and parts[:2] == ["v1", "orders"]:
            order = next((o for o in data.orders if o.id == parts[2]), None)
            if order is None:
                self._send(404, {"error": f"no order {parts[2]}"})
                return
            self._send(200, order_json(order))
        else:
            self._send(404, {"error": f"no route GET {url.path}"})

    def do_POST(self) -> None:  # http.server's name
        if not self._admit():
            return
        if urllib.parse.urlsplit(self.path).path != "/v1/answers":
            self._send(404, {"error": f"no route POST {self.path}"})
            return
        length = min(int(self.headers.get("Content-Length") or 0), 10_000)
        try:
            body = json.loads(self.rfile.read(length) or b"null")
        except json.JSONDecodeError:
            self._send(400, {"error": "body must be JSON"})
            return
        if (
            not isinstance(body, dict)
            or not isinstance(body.get("task_id"), str)
            or "answer" not in body
        ):
            self._send(400, {"error": 'body must be {"task_id": "...", "answer": ...}'})
            return
        if not self.state.submit(body["task_id"], body["answer"]):
            self._send(409, {"error": "an answer for this task was already submitted"})
            return
        self._send(200, {"accepted": True})


class ApiServer(LocalHTTPServer):
    """An ApiState served on 127.0.0.1 (free port) from a daemon thread; `close()` stops it."""

    def __init__(self, state: ApiState) -> None:
        self.state = state
        super().__init__(type("ApiHandler", (_Handler,), {"state": state}), "api")
