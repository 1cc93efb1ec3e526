"""What a server accepts: pure checks of submitted groups and generate requests.

No grpc, no torch: `check_group` returns the ack a group deserves before it is stored.
Codes follow gRPC's guide: malformed -> INVALID, too old -> STALE (not retried).
`check_shape` reads only the lengths of a group message, so one that is too big is refused
before it is copied into Python objects (a 16 MiB message of one-byte token ids would
otherwise become 16M Python ints). Values that are finite but absurd (a reward of 1e300,
a logprob of -1e30) are refused too: they would turn the GRPO loss into inf or NaN.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from jetctl.types import TrajectoryGroup


@dataclass(frozen=True)
class Limits:
    model: str
    vocab_size: int
    max_context_tokens: int
    max_staleness: int
    max_trajectories_per_group: int = 1024
    max_calls_per_trajectory: int = 1024
    max_groups_per_submit: int = 256
    max_id_chars: int = 256  # ids, task and model names (a uuid7 is 36)


# |reward| above this squares past 1e18 and sums of a group may overflow to inf
MAX_ABS_REWARD = 1e9
# a sampled token with log-probability below this (p < 1e-434) did not come from a sampler
MIN_LOGPROB = -1000.0


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
    # an entry is a revision (every task) or `<task>/<revision>` (swap-clients --drop-old)
    revs = {
        t.client_revision
        for t in g.trajectories
        if t.client_revision in refused_revisions
        or f"{t.task}/{t.client_revision}" in refused_revisions
    }
    if revs:
        return Verdict("revision", f"revision: client revision {min(revs)} is refused")
    lag = g.lag(version)
    if lag > limits.max_staleness:
        return Verdict(
            "stale", f"stale: lag {lag} > max_staleness {limits.max_staleness} at submit"
        )
    return Verdict("accepted")


def check_shape(group: Any, limits: Limits) -> str:
    """Why a `TrajectoryGroup` message is too big to convert ('' when it is not).

    Reads lengths only (of the protobuf message or of a dataclass alike)."""
    for what, text in (("group id", group.id), ("task", group.task), ("task_id", group.task_id),
                       ("model", group.model)):
        if len(text) > limits.max_id_chars:
            return f"{what} has {len(text)} characters > {limits.max_id_chars}"
    if len(group.trajectories) > limits.max_trajectories_per_group:
        return f"{len(group.trajectories)} trajectories > {limits.max_trajectories_per_group}"
    for t in group.trajectories:
        if max(len(t.id), len(t.group_id), len(t.client_revision)) > limits.max_id_chars:
            return f"a trajectory id, group_id or revision exceeds {limits.max_id_chars} characters"
        if len(t.calls) > limits.max_calls_per_trajectory:
            return f"a trajectory has {len(t.calls)} calls > {limits.max_calls_per_trajectory}"
        for c in t.calls:
            tokens = len(c.prompt_ids) + len(c.completion_ids)
            if tokens > limits.max_context_tokens:
                return f"a call of {tokens} tokens > max_context_tokens {limits.max_context_tokens}"
    return ""


def _invalid_reason(g: TrajectoryGroup, limits: Limits, version: int) -> str:
    shape = check_shape(g, limits)
    if shape:
        return shape
    if not g.id:
        return "group id is empty"
    if g.model != limits.model:
        return f"model {_short(g.model)} is not served here (this server trains {limits.model!r})"
    if not g.trajectories:
        return "group has no trajectories"
    seen: set[str] = set()
    for t in g.trajectories:
        if not t.id or t.id in seen:
            return f"trajectory id {t.id!r} is empty or repeated"
        seen.add(t.id)
        if t.group_id != g.id:
            return f"trajectory {t.id} has group_id {t.group_id!r}, expected {g.id!r}"
        if t.status != "ok":
            return f"trajectory {t.id} has status {_short(t.status)}; only ok ones are trained"
        if not abs(t.reward) <= MAX_ABS_REWARD:  # also NaN
            return f"trajectory {t.id} reward is {t.reward}, outside ±{MAX_ABS_REWARD:g}"
        if not t.calls:
            return f"trajectory {t.id} has no LLM calls"
        for i, c in enumerate(t.calls):
            reason = _call_reason(c.prompt_ids, c.completion_ids, c.completion_logprobs, limits)
            if reason:
                return f"trajectory {t.id} call {i}: {reason}"
            if c.model != limits.model:
                return f"trajectory {t.id} call {i}: model {_short(c.model)} is not served here"
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
    if min(logprobs) < MIN_LOGPROB:
        return f"logprob {min(logprobs):g} < {MIN_LOGPROB:g}: not from a sampler"
    return ""


def check_generate(
    model: str,
    prompt_ids: Sequence[int],
    max_tokens: int,
    limits: Limits,
    max_new_tokens: int,
    temperature: float = 1.0,
) -> str:
    """Why a Generate request is malformed ('' when fine). `prompt_ids` may be the
    protobuf's repeated field: it is only measured, never copied."""
    if model and model != limits.model:
        return f"model {_short(model)} is not served here (this server serves {limits.model!r})"
    if not prompt_ids:
        return "prompt_ids is empty"
    if len(prompt_ids) > limits.max_context_tokens:
        return f"prompt: {len(prompt_ids)} tokens > max_context_tokens {limits.max_context_tokens}"
    if not 0 <= temperature < math.inf:  # also NaN
        return f"temperature {temperature} is not a finite number >= 0"
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


def _short(text: str, keep: int = 64) -> str:
    """repr of `text`, cut to `keep` characters: reasons echo user input, so bound them."""
    return repr(text if len(text) <= keep else text[:keep] + "...")
