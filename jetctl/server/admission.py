"""What a server accepts: pure checks of submitted groups and generate requests.

No grpc, no torch: `check_group` returns the ack a group deserves before it is stored.
Codes follow gRPC's guide: malformed -> INVALID, too old -> STALE (not retried).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from jetctl.types import TrajectoryGroup


@dataclass(frozen=True)
class Limits:
    model: str
    vocab_size: int
    max_context_tokens: int
    max_staleness: int
    max_trajectories_per_group: int = 1024
    max_calls_per_trajectory: int = 1024


@dataclass(frozen=True)
class Verdict:
    outcome: str  # accepted | stale | invalid | revision
    reason: str = ""


def check_group(
    g: TrajectoryGroup, limits: Limits, version: int, refused_revisions: frozenset[str]
) -> Verdict:
    """The ack a group deserves at Submit, given the server's current version."""
    invalid = _invalid_reason(g, limits, version)
    if invalid:
        return Verdict("invalid", f"invalid: {invalid}")
    revs = {t.client_revision for t in g.trajectories} & refused_revisions
    if revs:
        return Verdict("revision", f"revision: client revision {sorted(revs)[0]} is refused")
    lag = g.lag(version)
    if lag > limits.max_staleness:
        return Verdict(
            "stale", f"stale: lag {lag} > max_staleness {limits.max_staleness} at submit"
        )
    return Verdict("accepted")


def _invalid_reason(g: TrajectoryGroup, limits: Limits, version: int) -> str:
    if not g.id:
        return "group id is empty"
    if g.model != limits.model:
        return f"model {g.model!r} is not served here (this server trains {limits.model!r})"
    if not g.trajectories:
        return "group has no trajectories"
    if len(g.trajectories) > limits.max_trajectories_per_group:
        return f"{len(g.trajectories)} trajectories > {limits.max_trajectories_per_group}"
    seen: set[str] = set()
    for t in g.trajectories:
        if not t.id or t.id in seen:
            return f"trajectory id {t.id!r} is empty or repeated"
        seen.add(t.id)
        if t.group_id != g.id:
            return f"trajectory {t.id} has group_id {t.group_id!r}, expected {g.id!r}"
        if t.status != "ok":
            return f"trajectory {t.id} has status {t.status!r}; only ok trajectories are trained"
        if not math.isfinite(t.reward):
            return f"trajectory {t.id} reward is {t.reward}"
        if not t.calls:
            return f"trajectory {t.id} has no LLM calls"
        if len(t.calls) > limits.max_calls_per_trajectory:
            return f"trajectory {t.id} has {len(t.calls)} calls > {limits.max_calls_per_trajectory}"
        for i, c in enumerate(t.calls):
            reason = _call_reason(c.prompt_ids, c.completion_ids, c.completion_logprobs, limits)
            if reason:
                return f"trajectory {t.id} call {i}: {reason}"
            if c.model != limits.model:
                return f"trajectory {t.id} call {i}: model {c.model!r} is not {limits.model!r}"
            if c.model_version > version or c.model_version < 0:
                return (
                    f"trajectory {t.id} call {i}: model_version {c.model_version} is not in "
                    f"[0, {version}]"
                )
    return ""


def _call_reason(
    prompt_ids: list[int], completion_ids: list[int], logprobs: list[float], limits: Limits
) -> str:
    if not prompt_ids or not completion_ids:
        return "empty prompt or completion"
    if len(completion_ids) != len(logprobs):
        return f"{len(completion_ids)} completion ids but {len(logprobs)} logprobs"
    if len(prompt_ids) + len(completion_ids) > limits.max_context_tokens:
        return (
            f"{len(prompt_ids) + len(completion_ids)} tokens > max_context_tokens "
            f"{limits.max_context_tokens}"
        )
    v = limits.vocab_size
    # min/max run in C: this check is on the Submit hot path
    if min(prompt_ids) < 0 or max(prompt_ids) >= v or min(completion_ids) < 0 or max(
        completion_ids
    ) >= v:
        return f"token id outside the vocabulary [0, {v})"
    # a logprob is <= 0 (allow 1e-3 of float noise); a sum is finite iff every term is
    if not math.isfinite(sum(logprobs)) or max(logprobs) > 1e-3:
        return "logprob is NaN, infinite or positive"
    return ""


def check_generate(
    model: str, prompt_ids: list[int], max_tokens: int, limits: Limits, max_new_tokens: int
) -> str:
    """Why a Generate request is malformed ('' when fine)."""
    if model and model != limits.model:
        return f"model {model!r} is not served here (this server serves {limits.model!r})"
    if not prompt_ids:
        return "prompt_ids is empty"
    if max_tokens < 0:
        return f"max_tokens {max_tokens} < 0"
    if len(prompt_ids) + min(max(max_tokens, 1), max_new_tokens) > limits.max_context_tokens:
        return (
            f"prompt of {len(prompt_ids)} tokens + max_tokens exceeds max_context_tokens "
            f"{limits.max_context_tokens}"
        )
    v = limits.vocab_size
    if min(prompt_ids) < 0 or max(prompt_ids) >= v:
        return f"token id outside the vocabulary [0, {v})"
    return ""
