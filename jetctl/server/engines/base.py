"""The inference engine's contract: token ids in, token ids and behaviour logprobs out.

The gRPC service talks to an engine through this interface only, so engines can differ in
how they batch and where their weights live:

- `generate(req)` returns the sampled completion's token ids, the untempered log-probability
  of each (log_softmax of the raw logits: the behaviour logprobs PPO-clip needs at
  temperature 1), the finish reason, and the model version that produced *every* token of
  the reply (a reply never mixes two versions).
- Cancelling the awaiting task (a client that hangs up) cancels the request: the engine does
  no more work for it that it can avoid, and keeps serving everyone else.
- `busy_since` is the monotonic start of the work under way (None when idle): the server's
  watchdog treats a batch older than its stall limit as a hang.

Engines that share the trainer's model object (hf with finetune: full) see each optimizer
step under the weights lock; engines with a copy of their own get the weights pushed after each step (planned per
engine, see the engine's module docstring).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal, Protocol

FinishReason = Literal["stop", "length"]


@dataclass
class GenRequest:
    prompt_ids: list[int]
    max_tokens: int
    temperature: float  # 0: greedy
    top_p: float
    stop_token_ids: tuple[int, ...] = ()
    seed: int | None = None  # the request's own sampling stream (the OpenAI seed); None: shared


@dataclass
class GenResult:
    completion_ids: list[int]
    completion_logprobs: list[float]
    model_version: int
    finish_reason: str  # stop | length


@dataclass
class EngineLoad:
    """How full the engine is now (the Generate reply carries it to the nodes)."""

    rows: int = 0  # replies being generated
    max_rows: int = 0  # the most it generates together (0: it does not say)
    queued: int = 0  # requests waiting for a row


class Engine(Protocol):
    @property
    def busy_since(self) -> float | None:
        """Monotonic start of the work under way; None when idle."""

    def start(self) -> None:
        """Begin serving; called from inside the server's running event loop."""

    async def stop(self) -> None:
        """Fail queued requests with an error and release the engine's workers."""

    def load(self) -> EngineLoad:
        """Rows in use and requests waiting, read without a lock (a snapshot)."""
        ...

    async def generate(self, req: GenRequest) -> GenResult:
        """One completion of `req`, at one model version."""
        ...
