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

Token ids and logprobs are the bulk of a group. `check_groups`, the server's path, checks
them over the packed bytes of every call of a Submit request at once (each group parsed a
second time as `packed.proto`'s `PackedGroup`), with bytes methods that screen each varint
by its length and top byte and each float by its top byte (numpy decodes the rare ones the
screen leaves open), without a Python object per element; a group that check cannot vouch
for (a value out of bounds, an element sent unpacked) is read element by element by
`check_group`, which finds the reason. Either way a group gets the same verdict.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

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


MAX_COST_KEYS, MAX_COST = 16, 1e9  # a trajectory's cost figures: a few, none absurd (or NaN)
# |reward| above this squares past 1e18 and sums of a group may overflow to inf
MAX_ABS_REWARD = 1e9
# a sampled token with log-probability below this (p < 1e-434) did not come from a sampler
MIN_LOGPROB = -1000.0
# a logprob is <= 0; allow this much float noise above it
MAX_LOGPROB = 1e-3
# packed token ids longer than this are checked group by group: the screen's copies and
# numpy's temporaries (about 25 bytes per byte) stay small however large a message is
MAX_PACKED_ID_BYTES = 1 << 20


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
    return _judge(g, _read_group(g, limits, version).facts, limits, version, refused_revisions)


def check_groups(
    groups: Sequence[Any], views: Sequence[Any | None], limits: Limits, version: int,
    refused_revisions: frozenset[str],
) -> list[Verdict]:
    """`check_group` of each group of a Submit request, the same verdicts, with every token
    id and logprob checked over the packed bytes of all the groups at once.

    `views[i]` is `groups[i]`'s `PackedGroup` (None: read that group element by element).
    Sound because a view holds a subset of each call's elements (its packed occurrences), so
    when their count equals the message's (`len`, which makes no element objects) it holds
    all of them."""
    reads = [
        _read_group(g, limits, version, values=False) if view is not None else None
        for g, view in zip(groups, views)
    ]
    # groups valid but for their values; each of the others is read element by element
    # (a reason found without the values may not be the first one with them)
    candidates = {i: r for i, r in enumerate(reads) if r is not None and r.values_to_check}
    vouched: dict[int, _Read] = {}
    if _packed_values_ok([views[i] for i in candidates], list(candidates.values()), limits):
        vouched = candidates
    elif len(candidates) > 1:  # one group (or an unpacked element) spoilt it: find which
        vouched = {
            i: r for i, r in candidates.items() if _packed_values_ok([views[i]], [r], limits)
        }
    return [
        _judge(g, vouched[i].facts, limits, version, refused_revisions)
        if i in vouched else check_group(g, limits, version, refused_revisions)
        for i, g in enumerate(groups)
    ]


def _judge(
    g: Any, facts: GroupFacts | str, limits: Limits, version: int,
    refused_revisions: frozenset[str],
) -> Verdict:
    """The verdict on a group read as `facts` (or the reason it is invalid)."""
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


def _trajectory_shape(t: Any, limits: Limits) -> str:
    """Why a trajectory is too big to read (its ids' lengths or its number of calls)."""
    if max(len(t.id), len(t.group_id), len(t.client_revision)) > limits.max_id_chars:
        return f"a trajectory id, group_id or revision exceeds {limits.max_id_chars} characters"
    return f"a trajectory has {len(t.calls)} calls > {limits.max_calls_per_trajectory}"


@dataclass(frozen=True)
class _Read:
    """A group read in one pass: its facts or why it is invalid, and how many token ids and
    logprobs its calls hold (counted by `len` when their values were not read)."""

    facts: GroupFacts | str
    n_ids: int = 0
    n_logprobs: int = 0
    values_to_check: bool = False  # valid, but its ids and logprobs were not read


def _read_group(g: Any, limits: Limits, version: int, values: bool = True) -> _Read:
    """One pass: the group's facts, or why it is invalid. Every length is checked before
    the elements behind it are read; token ids and logprobs only when `values`."""
    for what, text in (("group id", g.id), ("task", g.task), ("task_id", g.task_id),
                       ("model", g.model)):
        if len(text) > limits.max_id_chars:
            return _Read(f"{what} has {len(text)} characters > {limits.max_id_chars}")
    if len(g.trajectories) > limits.max_trajectories_per_group:
        return _Read(f"{len(g.trajectories)} trajectories > {limits.max_trajectories_per_group}")
    gid = g.id
    if not gid:
        return _Read("group id is empty")
    if g.model != limits.model:
        return _Read(
            f"model {_short(g.model)} is not served here (this server trains {limits.model!r})"
        )
    trajectories = g.trajectories
    if not trajectories:
        return _Read("group has no trajectories")
    n_ids = n_logprobs = 0
    ids: list[str] = []
    seen: set[str] = set()
    revisions: set[str] = set()
    rewards: list[float] = []
    min_version = version
    for t in trajectories:
        # each attribute of a protobuf message is read once: a read makes a Python object
        tid, group_id, revision, calls = t.id, t.group_id, t.client_revision, t.calls
        if (max(len(tid), len(group_id), len(revision)) > limits.max_id_chars
                or len(calls) > limits.max_calls_per_trajectory):
            return _Read(_trajectory_shape(t, limits))
        if not tid or tid in seen:
            return _Read(f"trajectory id {_short(tid)} is empty or repeated")
        if group_id != gid:
            return _Read(f"trajectory {tid} has group_id {_short(group_id)}, expected {gid!r}")
        if t.status != "ok":
            return _Read(
                f"trajectory {tid} has status {_short(t.status)}; only ok ones are trained"
            )
        reward = t.reward
        if not abs(reward) <= MAX_ABS_REWARD:  # also NaN
            return _Read(f"trajectory {tid} reward is {reward}, outside ±{MAX_ABS_REWARD:g}")
        if not calls:
            return _Read(f"trajectory {tid} has no LLM calls")
        costs = t.costs  # jetctl/costs.py sums them into the step rows
        if len(costs) > MAX_COST_KEYS or not all(
                0 <= v <= MAX_COST and len(k) <= limits.max_id_chars for k, v in costs.items()):
            return _Read(f"trajectory {tid} costs {_short(str(dict(costs)))}: at most "
                         f"{MAX_COST_KEYS} figures, each in [0, {MAX_COST:g}], each name at "
                         f"most {limits.max_id_chars} characters")
        for i, c in enumerate(calls):
            prompt_ids, completion_ids, logprobs = (
                c.prompt_ids, c.completion_ids, c.completion_logprobs
            )
            reason = _call_reason(prompt_ids, completion_ids, logprobs, limits, values)
            if reason:
                return _Read(f"trajectory {tid} call {i}: {reason}")
            if c.model != limits.model:
                return _Read(
                    f"trajectory {tid} call {i}: model {_short(c.model)} is not served here"
                )
            v = c.model_version
            if v > version or v < 0:
                return _Read(
                    f"trajectory {tid} call {i}: model_version {v} is not in [0, {version}]"
                )
            min_version = min(min_version, v)
            n_ids += len(prompt_ids) + len(completion_ids)
            n_logprobs += len(logprobs)
        ids.append(tid)
        seen.add(tid)
        revisions.add(revision)
        rewards.append(reward)
    facts = GroupFacts(
        id=gid, task=g.task, n_trajectories=len(ids), min_version=min_version,
        trajectory_ids=tuple(ids), revisions=tuple(sorted(revisions)),
        reward_sum=math.fsum(rewards),
    )
    return _Read(facts, n_ids, n_logprobs, values_to_check=not values)


def _call_reason(
    prompt_ids: Sequence[int], completion_ids: Sequence[int], logprobs: Sequence[float],
    limits: Limits, values: bool = True,
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
    if not values:
        return ""
    # Without packed bytes (or when they showed something out of bounds), each element is
    # read here. Reading a protobuf repeated field makes one Python object
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


def _packed_values_ok(views: Sequence[Any], reads: Sequence[_Read], limits: Limits) -> bool:
    """True when the packed bytes of `views` (`PackedGroup`s) hold exactly the token ids and
    logprobs that `reads` counted, every id in [0, vocab_size) and every logprob in
    [MIN_LOGPROB, MAX_LOGPROB]. False: not shown here, read the elements one by one."""
    id_chunks: list[bytes] = []
    lp_chunks: list[bytes] = []
    for view in views:
        for tv in view.trajectories:
            for cv in tv.calls:
                id_chunks += cv.prompt_ids
                id_chunks += cv.completion_ids
                lp_chunks += cv.completion_logprobs
    ids, lps = b"".join(id_chunks), b"".join(lp_chunks)
    n_ids = sum(r.n_ids for r in reads)
    n_logprobs = sum(r.n_logprobs for r in reads)
    if not n_ids or not n_logprobs or len(ids) > MAX_PACKED_ID_BYTES:
        return False
    return (
        len(lps) == 4 * n_logprobs and _logprobs_in_range(lps)
        and _varints_below(ids, n_ids, limits.vocab_size)
    )


def _varints_below(data: bytes, count: int, bound: int) -> bool:
    """True when `data` is exactly `count` varints, each < `bound` (<= 2**31).

    Read with bytes methods over a class per byte (`_VarintScreen`), not a number per
    varint; only when the classes leave a varint undecided are they all decoded (numpy).
    Below 2**31 a varint's value is the parser's int32 (the low 32 bits)."""
    screen = _VarintScreen.of(bound)
    marks = data.translate(screen.table)
    continuations = marks.count(b"c")
    if len(marks) - continuations != count or marks.endswith(b"c"):
        return False
    # every L-byte varint ends in a byte marked t, and none is longer: then all are below
    if screen.digits == 1:
        plain = not continuations and b"H" not in marks
    else:
        run = b"c" * (screen.digits - 1)
        n_runs = continuations if screen.digits == 2 else marks.count(run)
        plain = marks.count(run + b"t") == n_runs and (
            screen.digits == 2 or run + b"c" not in marks
        )
    return plain or _decoded_below(data, bound)


@dataclass(frozen=True)
class _VarintScreen:
    """Byte classes that bound varints by their length and top byte.

    A varint is 7 bits per byte, little-endian; its last byte is the one below 0x80. Let
    bound - 1 take L (`digits`) such digits and bound = T * 128**(L-1) + R. A varint of
    fewer than L bytes is < 128**(L-1) <= bound - 1; one of L bytes whose top byte is below
    T is below the bound. `table` marks each byte: c (continuation), t (a last byte below
    T), H (above it). The rest (longer varints, top bytes of T or more: rare, and values
    at or past the bound) are decoded."""

    table: bytes
    digits: int

    @classmethod
    @functools.lru_cache(maxsize=8)
    def of(cls, bound: int) -> _VarintScreen:
        digits = 1
        while 128**digits <= bound - 1:
            digits += 1
        top = bound // 128 ** (digits - 1)
        table = bytes(
            ord("c") if byte >= 0x80 else ord("t") if byte < top else ord("H")
            for byte in range(256)
        )
        return cls(table=table, digits=digits)


def _decoded_below(data: bytes, bound: int) -> bool:
    """True when every varint of `data` (at most 5 bytes each) is < `bound`, decoded."""
    b = np.frombuffer(data, np.uint8)
    ends = np.flatnonzero(b < 0x80)  # the last byte of each varint
    lengths = np.diff(ends, prepend=-1)
    if int(lengths.max()) > 5:
        return False
    place = np.arange(b.size) - np.repeat(ends - lengths + 1, lengths)  # in its varint
    # each byte's 7 bits at their place; a varint's value is the sum over its bytes, read as
    # differences of one running sum (np.add.reduceat pays per varint, this per byte)
    running = np.cumsum((b & 0x7F).astype(np.int64) << (7 * place))[ends]
    return int(np.diff(running, prepend=0).max()) < bound


def _logprobs_in_range(data: bytes) -> bool:
    """True when every float32 in `data` is in [MIN_LOGPROB, MAX_LOGPROB] (NaN is not).

    Read first by each float's top byte (its sign and high 7 exponent bits): most logprobs
    have one that puts them inside the bounds whatever the other bytes hold
    (`_PLAIN_LOGPROB_TOPS`); only when some float has another are all compared (numpy)."""
    if not data[3::4].translate(None, _PLAIN_LOGPROB_TOPS):  # little-endian: byte 3 is the top
        return True
    lps = np.frombuffer(data, "<f4")
    # compared as Python floats (float64), as the element-by-element check compares them
    low, high = float(np.minimum.reduce(lps)), float(np.maximum.reduce(lps))
    return MIN_LOGPROB <= low and high <= MAX_LOGPROB


def _plain_top_bytes() -> bytes:
    """Top bytes of the float32s that are all within [MIN_LOGPROB, MAX_LOGPROB].

    A top byte holds the sign and the exponent's high 7 bits k, so every float with it has a
    magnitude below 2**(2k + 2 - 127) (the exponent is 2k or 2k + 1, biased by 127); NaN
    and inf (k = 127) are never plain."""
    plain = bytearray()
    for top in range(256):
        bound = MAX_LOGPROB if top < 0x80 else -MIN_LOGPROB
        if 2.0 ** (2 * (top & 0x7F) + 2 - 127) <= bound:
            plain.append(top)
    return bytes(plain)


_PLAIN_LOGPROB_TOPS = _plain_top_bytes()  # [0, 2**-11) and (-512, -0]


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
