"""The data model, one name on the wire and in code (docs/architecture.md section 3).

Pure dataclasses: importable without grpc or torch. jetctl.proto.convert maps them to and
from protobuf messages.
"""

from __future__ import annotations

import os
import time
import uuid
from dataclasses import dataclass, field
from typing import Literal

TrajectoryStatus = Literal["ok", "failed", "timeout"]
FinishReason = Literal["stop", "length", "tool_calls"]


def uuid7() -> str:
    """A time-ordered UUID (RFC 9562 version 7): 48-bit ms timestamp, then random bits."""
    ms = time.time_ns() // 1_000_000
    rand = int.from_bytes(os.urandom(10), "big")
    rand_a = (rand >> 68) & 0xFFF
    rand_b = rand & ((1 << 62) - 1)
    value = ((ms & ((1 << 48) - 1)) << 80) | (0x7 << 76) | (rand_a << 64) | (0b10 << 62) | rand_b
    return str(uuid.UUID(int=value))


@dataclass
class LLMCall:
    """One request to a model: the exact token ids in and out, and who produced them."""

    model: str
    prompt_ids: list[int]
    completion_ids: list[int]
    completion_logprobs: list[float]
    model_version: int
    finish_reason: str = "stop"


@dataclass
class Trajectory:
    """One rollout of one role: its LLM calls (the timeline) and its reward."""

    id: str
    group_id: str
    task: str
    task_id: str
    client_id: str = ""
    client_revision: str = ""
    role: str = "default"
    calls: list[LLMCall] = field(default_factory=list)
    reward: float = 0.0
    status: TrajectoryStatus = "ok"
    error: str = ""
    timings: dict[str, float] = field(default_factory=dict)
    metadata: dict[str, str] = field(default_factory=dict)
    # its share of the rollout's cost outside the server: usd/<kind>, client_cpu_s, env_s
    costs: dict[str, float] = field(default_factory=dict)

    @property
    def min_version(self) -> int:
        """Oldest model version that produced any call (-1 with no calls)."""
        return min((c.model_version for c in self.calls), default=-1)


@dataclass
class TrajectoryGroup:
    """A GRPO group: rollouts of the same task, sent to one model's server."""

    id: str
    task: str
    task_id: str
    model: str
    trajectories: list[Trajectory] = field(default_factory=list)

    @property
    def min_version(self) -> int:
        return min((t.min_version for t in self.trajectories), default=-1)

    def lag(self, server_version: int) -> int:
        """server_version - min(call versions): how many steps behind the oldest call is."""
        return server_version - self.min_version
