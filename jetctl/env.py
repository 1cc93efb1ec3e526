"""The contract between jetctl, task environments (envs/) and agent programs (agents/).

An environment makes tasks and opens one session per rollout; the agent drives the
session and calls the model through the OpenAI-compatible endpoint in `llm`; the node
asks the session for the reward when the agent returns. Agents may be plain or `async`
functions. A rollout runs in its own process group, so a timeout kills it whole.

    def make_env(**env_args) -> Env
    def agent(task: Task, llm: LLM, session: Session) -> None      # or async def

A session that pays for something outside jetctl (a paid API, an LLM judge, a sandbox)
reports it by mixing in `Spending` and calling `self.cost(usd=0.002, kind="judge")` (the
agent may call `session.cost(...)` too). The spend travels with the rollout's trajectories
and is summed per step and per task in the step rows (jetctl/costs.py). The rollout process
sends each `cost` call's running total to the node as it happens (`on_cost`), so a rollout
killed for its timeout keeps the spend it reported.
"""

from __future__ import annotations

import math
import random
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass, field
from typing import Any, Protocol


@dataclass(frozen=True)
class Task:
    """One task instance. `id` is stable (same task -> same id); `data` is env-specific."""

    id: str
    prompt: str
    data: dict[str, Any] = field(default_factory=dict)


@dataclass(frozen=True)
class Position:
    """Where a node is in a dataset env's stream (jetctl.envs.dataset, leased row by row from
    the controller: jetctl/client/rows.py): the epoch, and the position within its permutation."""

    epoch: int
    index: int  # position in the epoch's permutation (not a row id)


@dataclass(frozen=True)
class LLM:
    """Where the agent reaches the model: an OpenAI-compatible endpoint on the client node.

    `model` is the name to pass as `model=`. In a team task (`roles:` in the recipe) the
    agent names a role instead, one of `roles` (`model` is then the first of them); each
    role's calls train that role's model."""

    base_url: str
    model: str
    api_key: str = "jetctl"
    roles: tuple[str, ...] = ()  # a team task's role names; () for a task with one model

    def client(self) -> Any:
        """An `openai.OpenAI` client bound to this endpoint."""
        import openai

        return openai.OpenAI(
            base_url=self.base_url, api_key=self.api_key, max_retries=0,
            http_client=openai.DefaultHttpxClient(**self._http_options()),
        )

    def async_client(self) -> Any:
        """An `openai.AsyncOpenAI` client bound to this endpoint."""
        import openai

        return openai.AsyncOpenAI(
            base_url=self.base_url, api_key=self.api_key, max_retries=0,
            http_client=openai.DefaultAsyncHttpxClient(**self._http_options()),
        )

    def _http_options(self) -> dict[str, Any]:
        # The SDK's own HTTP client class (its timeouts and limits), but the node's endpoint
        # is plain HTTP on loopback: no CA bundle to load (~60 ms of CPU per client, i.e.
        # per rollout) and no proxies from the environment.
        local = self.base_url.startswith("http://")
        return {"verify": not local, "trust_env": not local}


class Session(Protocol):
    """One rollout's view of the environment. Env-specific tools are extra methods."""

    def reward(self) -> float | Mapping[str, float]:
        """Score of the session so far, checked by code (called once the agent returns).

        A team task's session may score each role on its own: a mapping role -> reward
        (every role that made calls needs one); a number is every role's reward."""
        ...

    def close(self) -> None:
        ...


class Spending:
    """Mix into a Session to report spend outside jetctl, in US dollars by kind:

        class JudgedSession(Spending):
            def reward(self) -> float:
                verdict = judge(...)
                self.cost(usd=verdict.usage_usd, kind="judge")
                ...

    Needs no `__init__` call (works beside dataclasses). A failed or timed-out rollout's
    spend counts as waste (jetctl/costs.py): it trained nothing."""

    def cost(self, usd: float, kind: str = "api") -> None:
        """Add `usd` (>= 0, finite) to this session's spend of `kind`."""
        if not (isinstance(usd, (int, float)) and math.isfinite(usd) and usd >= 0):
            raise ValueError(f"session.cost(usd={usd!r}): give a finite number of dollars >= 0")
        if not kind or "/" in kind:
            raise ValueError(f"session.cost(kind={kind!r}): name the kind without '/' "
                             "(api, judge, sandbox)")
        spent: dict[str, float] = self.__dict__.setdefault("_jetctl_spent", {})
        spent[kind] = spent.get(kind, 0.0) + float(usd)
        report = self.__dict__.get("_jetctl_on_cost")
        if report is not None:
            report(dict(spent))


def on_cost(session: object, report: Callable[[dict[str, float]], None]) -> None:
    """Call `report(spent(session))` now and after each later `session.cost(...)` (the rollout
    process sends each to the node: a rollout killed before it ends keeps what it spent)."""
    if isinstance(session, Spending):
        session.__dict__["_jetctl_on_cost"] = report
    report(spent(session))


def spent(session: object) -> dict[str, float]:
    """kind -> US dollars a session reported through `Spending.cost` ({} for any other)."""
    return dict(session.__dict__.get("_jetctl_spent", {})) if isinstance(session, Spending) else {}


class Env(Protocol):
    name: str

    def tasks(self, rng: random.Random) -> Iterator[Task]:
        """An endless stream of tasks drawn with rng."""
        ...

    def open(self, task: Task) -> Session:
        ...


class LocalHTTPServer:
    """An http.server handler served on 127.0.0.1 (free port) from a daemon thread.

    For environments that serve their own site or API to the agent; `close()` stops it.
    """

    def __init__(self, handler: type, name: str) -> None:
        import threading
        from http.server import ThreadingHTTPServer

        self._httpd = ThreadingHTTPServer(("127.0.0.1", 0), handler)
        self._httpd.daemon_threads = True
        self.port = int(self._httpd.server_address[1])
        self._thread = threading.Thread(target=self._httpd.serve_forever, name=name, daemon=True)
        self._thread.start()

    @property
    def base_url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def close(self) -> None:
        self._httpd.shutdown()
        self._httpd.server_close()
