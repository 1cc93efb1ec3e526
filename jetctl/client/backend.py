"""What a client node generates through: the `Backend` protocol and its request, result and
error types.

Two backends implement it: the server's `Generate` over gRPC (`transport.GenerateBackend`)
and the node's own engine (`local_engine`). The proxy (`proxy.py`) renders an agent's
OpenAI request to token ids and calls one; the backends import these types from here, not
from the proxy above them.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol


@dataclass(frozen=True)
class GenerateResult:
    """What a backend produced for one prompt."""

    completion_ids: list[int]
    completion_logprobs: list[float]
    model_version: int
    finish_reason: str  # stop | length


@dataclass(frozen=True)
class GenerateParams:
    prompt_ids: list[int]
    max_tokens: int
    temperature: float
    top_p: float
    stop_token_ids: list[int]
    request_id: str
    seed: int | None = None  # the OpenAI seed; None: unseeded


class Backend(Protocol):
    """Token ids in, token ids + logprobs + model version out."""

    async def generate(self, params: GenerateParams) -> GenerateResult: ...


class BackendError(Exception):
    """The model could not answer (server unreachable, refused, ...): HTTP 503 to the agent."""

    def __init__(self, message: str, status: int = 503) -> None:
        super().__init__(message)
        self.status = status
