"""ApiEnv / ApiSession (see the package docstring for the tasks, levels and reward)."""

from __future__ import annotations

import hashlib
import json
import random
import secrets
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

from envs.api.service import (
    PRODUCTS,
    ApiServer,
    ApiState,
    Dataset,
    Order,
    RateLimiter,
    Secret,
    User,
    make_dataset,
)
from envs.levels import (
    ActionLog,
    Level,
    LevelledSession,
    check_level,
    easy_reward,
    example_call,
)
from jetctl.env import Task

TASK_KINDS = ("shipped_total", "units")
HARD_SYSTEM = "You answer questions by calling a JSON REST API with the http tool."
EASY_SYSTEM = "You fetch resources from a JSON REST API."
# the task names its endpoint; the model fills in the id (the prior exchange shows how)
EASY_PROMPT = "Fetch {what}: GET {endpoint}. Call get."
EASY_KINDS = ("order", "user", "user_orders")
EASY_ENDPOINTS = {"order": "/v1/orders/<order id>", "user": "/v1/users/<user id>",
                  "user_orders": "/v1/users/<user id>/orders"}  # fmt: skip
TOOLS_BY_LEVEL: dict[Level, tuple[str, ...]] = {"easy": ("get",), "hard": ("http",)}
MAX_STEPS_BY_LEVEL: dict[Level, int] = {"easy": 1, "hard": 16}
EXAMPLE_ORDER = 0  # index into the dataset's orders; never asked as an easy task
METHODS = ("GET", "POST")
GUIDE = (
    "Use the http tool on the shop's REST API (JSON; credentials are added for you). "
    "Endpoints: GET /v1/users?name=<part of a name>, GET /v1/users/<id>, "
    "GET /v1/users/<id>/orders?page=N (follow next_page), GET /v1/orders/<id> (items with "
    'qty and unit_price_cents), POST /v1/answers with {{"task_id": "{task_id}", '
    '"answer": <integer>}}. Only the first answer counts.'
)


class ApiToolError(ValueError):
    """A tool call the session refuses (told to the model as the tool's result)."""


@dataclass(frozen=True)
class HttpReply:
    status: int
    body: str
    retry_after: str | None
    waited_s: float


@dataclass
class ApiSession(LevelledSession):
    """One rollout: its own service (own rate-limit bucket and answers); `http()` calls it."""

    tools_by_level = TOOLS_BY_LEVEL
    max_steps_by_level = MAX_STEPS_BY_LEVEL

    task: Task
    server: ApiServer
    api_key: Secret = field(repr=False)
    max_retries_429: int = 3
    max_wait_s: float = 10.0
    max_body_chars: int = 4000
    level: Level = "hard"
    example: tuple[dict[str, Any], ...] = ()  # the easy level's prior exchange
    log_actions: bool = False
    calls: int = 0
    closed: bool = False

    def __post_init__(self) -> None:
        self.actions = ActionLog("api", self.level, self.task.id)

    def opening(self) -> list[dict[str, Any]]:
        """The conversation the agent starts from (easy: after the prior exchange)."""
        system = HARD_SYSTEM if self.level == "hard" else EASY_SYSTEM
        return [
            {"role": "system", "content": system},
            *self.example,
            {"role": "user", "content": self.task.prompt},
        ]

    def request(self, method: str, path: str, body: Any = None) -> HttpReply:
        """One HTTP call to the service with the credential added; a 429 is waited out
        (Retry-After seconds, at most `max_wait_s` each) and retried up to `max_retries_429`
        times. Only paths on the service are accepted, so the credential goes nowhere else."""
        method = method.upper()
        if method not in METHODS:
            raise ApiToolError(f"method must be one of {', '.join(METHODS)}, got {method!r}")
        if not path.startswith("/") or path.startswith("//"):
            raise ApiToolError(f"path must start with a single '/', like /v1/users, got {path!r}")
        if any(c.isspace() or ord(c) < 32 or ord(c) == 127 for c in path):
            raise ApiToolError(f"path must not hold spaces or control characters (%-encode "
                               f"them, e.g. %20), got {path!r}")  # fmt: skip
        waited = 0.0
        for attempt in range(self.max_retries_429 + 1):
            reply = self._send(method, path, body)
            if reply.status != 429 or attempt == self.max_retries_429:
                return HttpReply(reply.status, reply.body, reply.retry_after, waited)
            wait = _retry_after_s(reply.retry_after)
            if wait > self.max_wait_s:
                return HttpReply(reply.status, reply.body, reply.retry_after, waited)
            time.sleep(wait)
            waited += wait
        raise AssertionError("unreachable: the last attempt returns")

    def _as_text(self, tool: str, args: dict[str, Any], method: str, path: str,
                 body: Any) -> str:  # fmt: skip
        """`request` as text for the model (status line, then the JSON body), logged."""
        try:
            reply = self.request(method, path, body)
        except ApiToolError as e:
            self.actions.record(tool, args, f"error: {e}")
            raise
        note = f" (waited {reply.waited_s:g}s for the rate limit)" if reply.waited_s else ""
        text = reply.body
        if len(text) > self.max_body_chars:
            text = text[: self.max_body_chars] + "[...]"
        result = f"HTTP {reply.status}{note}\n{text}"
        self.actions.record(tool, args, result)
        return result

    def http(self, method: str, path: str, body: Any = None) -> str:
        """`request` as text for the model: status line, then the JSON body."""
        args = {"method": method, "path": path, "body": body}
        return self._as_text("http", args, method, path, body)

    def get(self, path: str) -> str:
        """GET `path` (the easy level's one tool)."""
        return self._as_text("get", {"path": path}, "GET", path, None)

    def _send(self, method: str, path: str, body: Any) -> HttpReply:
        self.calls += 1
        data = None if body is None else json.dumps(body).encode()
        req = urllib.request.Request(self.server.base_url + path, data=data, method=method)
        req.add_header("Authorization", "Bearer " + self.api_key.reveal())
        if data is not None:
            req.add_header("Content-Type", "application/json")
        try:
            with urllib.request.urlopen(req, timeout=30) as resp:
                return HttpReply(resp.status, resp.read().decode(errors="replace"), None, 0.0)
        except urllib.error.HTTPError as e:
            text = e.read().decode(errors="replace")
            return HttpReply(e.code, text, e.headers.get("Retry-After"), 0.0)
        except urllib.error.URLError as e:  # the message names the reason, never the headers
            raise ApiToolError(f"the API could not be reached: {e.reason}") from None

    @property
    def answered(self) -> bool:
        """Whether an answer for this task was submitted."""
        return self.task.id in self.server.state.answers

    def task_score(self) -> float:
        """From the service's own records. Hard: 1.0 if it holds the right answer for this
        task. Easy: 1.0 if it served the task's resource (200 to a GET of its path)."""
        if self.task.data.get("level") == "easy":
            served = self.server.state.served
            return 1.0 if ("GET", self.task.data["path"], 200) in served else 0.0
        answer = self.server.state.answers.get(self.task.id)
        return 1.0 if _as_int(answer) == self.task.data["answer"] else 0.0

    def reward(self) -> float:
        """Hard: the task score. Easy: 0.2 for a well-formed action + 0.8 * the task score."""
        if self.level == "hard":
            return self.task_score()
        return easy_reward(self.task_score(), self.actions.well_formed, self.max_steps)

    def close(self) -> None:
        if not self.closed:
            self.closed = True
            if self.log_actions:
                self.actions.dump(self.reward())
            self.server.close()


def _task_id(seed: int, kind: str, *parts: str) -> str:
    """Stable, and opaque: the id is in the prompt and must not give the user id away."""
    digest = hashlib.sha256(":".join([str(seed), kind, *parts]).encode()).hexdigest()[:12]
    return f"api-{kind}-{digest}"


def _retry_after_s(value: str | None) -> float:
    """Retry-After in seconds (the delta-seconds form; 1 s when absent or a date)."""
    try:
        return max(0.0, float(value)) if value is not None else 1.0
    except ValueError:
        return 1.0


def _as_int(value: Any) -> int | None:
    if isinstance(value, bool):
        return None
    if isinstance(value, int):
        return value
    if isinstance(value, float) and value.is_integer():
        return int(value)
    if isinstance(value, str) and value.strip().lstrip("-").isdigit():
        return int(value.strip())
    return None


@dataclass
class ApiEnv:
    """Lookup tasks over a dataset fixed by `seed`; ids `api-<kind>-<opaque hash>`."""

    api_key: Secret = field(repr=False)
    seed: int = 0
    rate_per_s: float = 5.0
    burst: int = 5
    max_retries_429: int = 3
    level: Level = "hard"
    log_actions: bool = False
    name: str = "api"
    data: Dataset = field(init=False, repr=False)

    def __post_init__(self) -> None:
        self.level = check_level(self.level)
        self.data = make_dataset(self.seed)
        RateLimiter(self.rate_per_s, self.burst)  # checks the numbers

    def task(self, kind: str, user: User, product: str | None = None) -> Task:
        orders = self.data.orders_of(user.id)
        if kind == "shipped_total":
            answer = sum(o.total_cents for o in orders if o.status == "shipped")
            question = (
                f"What is the total value, in cents, of all orders of {user.name} with status "
                "'shipped' (sum of qty * unit_price_cents over their items)?"
            )
            task_id = _task_id(self.seed, kind, user.id)
        elif kind == "units" and product is not None:
            answer = sum(
                i.qty for o in orders if o.status != "cancelled" for i in o.items
                if i.product == product
            )  # fmt: skip
            question = (
                f"How many units of {product} has {user.name} ordered in total, counting every "
                "order that is not 'cancelled'?"
            )
            task_id = _task_id(self.seed, kind, user.id, product)
        else:
            raise ValueError(f"kind ({kind!r}) must be shipped_total, or units with a product")
        return Task(
            id=task_id,
            prompt=f"{question} {GUIDE.format(task_id=task_id)}",
            data={"kind": kind, "answer": answer, "seed": self.seed},
        )

    def easy_task(self, kind: str, order: Order) -> Task:
        """Fetch one resource: the order, its user, or its user's orders."""
        if order == self.data.orders[EXAMPLE_ORDER]:
            raise ValueError(f"order {order.id} is the easy level's example, never a task")
        what, path = {
            "order": (f"order {order.id}", f"/v1/orders/{order.id}"),
            "user": (f"user {order.user_id}", f"/v1/users/{order.user_id}"),
            "user_orders": (f"the orders of user {order.user_id}",
                            f"/v1/users/{order.user_id}/orders"),
        }[kind]  # fmt: skip
        return Task(
            id=_task_id(self.seed, "easy", kind, order.id),
            prompt=EASY_PROMPT.format(what=what, endpoint=EASY_ENDPOINTS[kind]),
            data={"kind": kind, "path": path, "seed": self.seed, "level": "easy"},
        )

    def example(self) -> tuple[dict[str, Any], ...]:
        """The easy level's prior exchange: fetch an order, and the call that does it."""
        order = self.data.orders[EXAMPLE_ORDER]
        task = EASY_PROMPT.format(what=f"order {order.id}", endpoint=EASY_ENDPOINTS["order"])
        return (
            {"role": "user", "content": task},
            example_call("get", path=f"/v1/orders/{order.id}"),
        )

    def tasks(self, rng: random.Random) -> Iterator[Task]:
        if self.level == "easy":
            orders = [o for i, o in enumerate(self.data.orders) if i != EXAMPLE_ORDER]
            while True:
                yield self.easy_task(rng.choice(EASY_KINDS), rng.choice(orders))
        while True:
            user = rng.choice(self.data.users)
            if rng.choice(TASK_KINDS) == "units":
                yield self.task("units", user, rng.choice(sorted(PRODUCTS)))
            else:
                yield self.task("shipped_total", user)

    def open(self, task: Task) -> ApiSession:
        if task.data.get("level", "hard") != self.level:
            raise ValueError(f"task {task.id} is not a task of the {self.level} level")
        state = ApiState(self.data, self.api_key, RateLimiter(self.rate_per_s, self.burst))
        return ApiSession(
            task, ApiServer(state), self.api_key, self.max_retries_429, level=self.level,
            example=self.example() if self.level == "easy" else (), log_actions=self.log_actions,
        )  # fmt: skip


def make_env(
    api_key: str | None = None,
    seed: int = 0,
    rate_per_s: float = 5.0,
    burst: int = 5,
    max_retries_429: int = 3,
    level: Level = "hard",
    log_actions: bool = False,
) -> ApiEnv:
    """The api env (see the package docstring). `api_key`: pass `${VAR}` in the recipe;
    None makes a random key for this env."""
    if api_key is not None and not api_key.strip():
        raise ValueError("api_key is empty: is the variable named in env_args' ${...} set?")
    key = Secret(api_key if api_key is not None else secrets.token_urlsafe(24))
    return ApiEnv(
        api_key=key, seed=seed, rate_per_s=rate_per_s, burst=burst,
        max_retries_429=max_retries_429, level=level, log_actions=log_actions,
    )  # fmt: skip
