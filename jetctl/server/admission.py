"""What a server accepts: pure checks of submitted groups and generate requests.

No grpc, no torch: `check_group` returns the ack a group deserves before it is stored.
Codes follow gRPC's guide: malformed -> INVALID, too old -> STALE (not retried).

The server checks a group as the protobuf message it received, in one pass, without copying
it into Python objects: every length is read before the elements behind it, so a 16 MiB
message of one-byte token ids is refused by its lengths, not turned into 16M Python ints.
The same pass gathers the facts the store records (`GroupFacts`). Values that are finite but
absurd (a reward of 1e300, a logprob of -1e30) are refused too: they would turn the GRPO
loss into inf or NaN. The checks read attributes only, so a `TrajectoryGroup` dataclass is
judged the same way (tests).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from jetctl.server.store import GroupFacts


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
# a logprob is <= 0; allow this much float noise above it
MAX_LOGPROB = 1e-3


@dataclass(frozen=True)
class Verdict:
    outcome: str  # accepted | stale | invalid | revision
    reason: str = ""
    facts: GroupFacts | None = None  # None when invalid


def check_group(
    g: Any, limits: Limits, version: int, refused_revisions: frozenset[str]
) -> Verdict:
    """The ack a group deserves at Submit, given the server's current version.

    `g` is a `TrajectoryGroup` protobuf message (read in place) or dataclass."""
    facts = _read_group(g, limits, version)
    if isinstance(facts, str):
        return Verdict("invalid", f"invalid: {facts}")
    # an entry is a revision (every task) or `<task>/<revision>` (swap-clients --drop-old)
    if refused_revisions:
        revs = {
            t.client_revision
            for t in g.trajectories
            if t.client_revision in refused_revisions
            or f"{t.task}/{t.client_revision}" in refused_revisions
        }
        if revs:
            return Verdict(
                "revision", f"revision: client revision {min(revs)} is refused", facts
            )
    lag = facts.lag(version)
    if lag > limits.max_staleness:
        return Verdict(
            "stale", f"stale: lag {lag} > max_staleness {limits.max_staleness} at submit", facts
        )
    return Verdict("accepted", "", facts)


def check_shape(group: Any, limits: Limits) -> str:
    """Why a `TrajectoryGroup` is too big to read element by element ('' when it is not).

    Reads lengths only (of the protobuf message or of a dataclass alike)."""
    reason = _ids_too_long(group, limits) or _too_many_trajectories(group, limits)
    if reason:
        return reason
    for t in group.trajectories:
        reason = _trajectory_shape(t, limits)
        if reason:
            return reason
        for c in t.calls:
            tokens = len(c.prompt_ids) + len(c.completion_ids)
            if tokens > limits.max_context_tokens:
                return f"a call of {tokens} tokens > max_context_tokens {limits.max_context_tokens}"
    return ""


def _ids_too_long(group: Any, limits: Limits) -> str:
    for what, text in (("group id", group.id), ("task", group.task), ("task_id", group.task_id),
                       ("model", group.model)):
        if len(text) > limits.max_id_chars:
            return f"{what} has {len(text)} characters > {limits.max_id_chars}"
    return ""


def _too_many_trajectories(group: Any, limits: Limits) -> str:
    n = len(group.trajectories)
    if n > limits.max_trajectories_per_group:
        return f"{n} trajectories > {limits.max_trajectories_per_group}"
    return ""


def _trajectory_shape(t: Any, limits: Limits) -> str:
    if max(len(t.id), len(t.group_id), len(t.client_revision)) > limits.max_id_chars:
        return f"a trajectory id, group_id or revision exceeds {limits.max_id_chars} characters"
    if len(t.calls) > limits.max_calls_per_trajectory:
        return f"a trajectory has {len(t.calls)} calls > {limits.max_calls_per_trajectory}"
    return ""


def _read_group(g: Any, limits: Limits, version: int) -> GroupFacts | str:
    """One pass: the group's facts, or why it is invalid. Every length is checked before
    the elements behind it are read."""
    reason = _ids_too_long(g, limits) or _too_many_trajectories(g, limits)
    if reason:
        return reason
    gid = g.id
    if not gid:
        return "group id is empty"
    if g.model != limits.model:
        return f"model {_short(g.model)} is not served here (this server trains {limits.model!r})"
    trajectories = g.trajectories
    if not trajectories:
        return "group has no trajectories"
    ids: list[str] = []
    seen: set[str] = set()
    revisions: set[str] = set()
    rewards: list[float] = []
    min_version = version
    for t in trajectories:
        # each attribute of a protobuf message is read once: a read makes a Python object
        tid, group_id, revision, calls = t.id, t.group_id, t.client_revision, t.calls
        if max(len(tid), len(group_id), len(revision)) > limits.max_id_chars:
            return _trajectory_shape(t, limits)
        if len(calls) > limits.max_calls_per_trajectory:
            return _trajectory_shape(t, limits)
        if not tid or tid in seen:
            return f"trajectory id {_short(tid)} is empty or repeated"
        if group_id != gid:
            return f"trajectory {tid} has group_id {_short(group_id)}, expected {gid!r}"
        if t.status != "ok":
            return f"trajectory {tid} has status {_short(t.status)}; only ok ones are trained"
        reward = t.reward
        if not abs(reward) <= MAX_ABS_REWARD:  # also NaN
            return f"trajectory {tid} reward is {reward}, outside ±{MAX_ABS_REWARD:g}"
        if not calls:
            return f"trajectory {tid} has no LLM calls"
        for i, c in enumerate(calls):
            reason = _call_reason(c.prompt_ids, c.completion_ids, c.completion_logprobs, limits)
            if reason:
                return f"trajectory {tid} call {i}: {reason}"
            if c.model != limits.model:
                return f"trajectory {tid} call {i}: model {_short(c.model)} is not served here"
            v = c.model_version
            if v > version or v < 0:
                return f"trajectory {tid} call {i}: model_version {v} is not in [0, {version}]"
            min_version = min(min_version, v)
        ids.append(tid)
        seen.add(tid)
        revisions.add(revision)
        rewards.append(reward)
    return GroupFacts(
        id=gid, task=g.task, n_trajectories=len(ids), min_version=min_version,
        trajectory_ids=tuple(ids), revisions=tuple(sorted(revisions)),
        reward_sum=math.fsum(rewards),
    )


def _call_reason(
    prompt_ids: Sequence[int], completion_ids: Sequence[int], logprobs: Sequence[float],
    limits: Limits,
) -> str:
    n_prompt, n_completion = len(prompt_ids), len(completion_ids)
    if not n_prompt or not n_completion:
        return "empty prompt or completion"
    if n_completion != len(logprobs):
        return f"{n_completion} completion ids but {len(logprobs)} logprobs"
    if n_prompt + n_completion > limits.max_context_tokens:
        return (
            f"{n_prompt + n_completion} tokens > max_context_tokens {limits.max_context_tokens}"
        )
    # This is the Submit hot path. Reading a protobuf repeated field makes one Python object
    # per element, so each field is read once, into a list (bounded by the lengths above),
    # and min and max then run over the list in C.
    ids = list(prompt_ids)
    ids += completion_ids
    v = limits.vocab_size
    if min(ids) < 0 or max(ids) >= v:
        return f"token id outside the vocabulary [0, {v})"
    lps = list(logprobs)
    # a sum is finite iff every term is (NaN and inf propagate)
    if not math.isfinite(sum(lps)) or max(lps) > MAX_LOGPROB:
        return "logprob is NaN, infinite or positive"
    if min(lps) < MIN_LOGPROB:
        return f"logprob {min(lps):g} < {MIN_LOGPROB:g}: not from a sampler"
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
