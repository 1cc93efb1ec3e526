"""Rewards for dataset tasks: how a completion is scored against its row.

A reward is `fn(completion, row) -> number | {role: number}`, plain or `async`, named in a
recipe as `module:fn` (`env_args.reward` of `jetctl.envs.dataset`). `completion` is the
assistant's last reply (a string); a reward that wants the whole conversation declares a
third parameter, `messages`. `row` is the dataset row (every column). `score` calls it
with a timeout; a reward that raises or runs past its timeout raises `RewardError`, which
makes the rollout a failed one (recorded with its traceback, kept out of the group), never
a zero.

Built-in rewards (used as `jetctl.rewards:exact_match` and `jetctl.rewards:math_equal`):

* `exact_match`: the answer extracted from the completion (`<answer>...</answer>` tags,
  else `\\boxed{...}`, else the last number) equals the row's `answer` column after
  normalising whitespace, case and number formatting (`1,000` = `1000` = `1000.0`).
* `math_equal`: the extracted answer and the row's answer are equal as mathematics,
  through `math-verify` (`1/2` = `0.5` = `\\frac{1}{2}`).

`make_answer_reward(extract, partial)` builds the same with another extraction order or a
partial credit for a well-formed but wrong answer (what the shipped word-problem recipe
uses: a dense signal for a 135M model).

Left out: LLM-as-judge rewards, and rewards that need the env's tools (write an env).
"""

from __future__ import annotations

import asyncio
import inspect
import re
import threading
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Literal

Extraction = Literal["tags", "boxed", "last_number"]
DEFAULT_EXTRACT: tuple[Extraction, ...] = ("tags", "boxed", "last_number")

ANSWER_TAG_RE = re.compile(r"<answer>(.*?)</answer>", re.IGNORECASE | re.DOTALL)
NUMBER_RE = re.compile(r"-?\d[\d,]*(?:\.\d+)?|-?\.\d+")
BOXED = "\\boxed{"


class RewardError(Exception):
    """The reward function raised or timed out: the rollout failed (not a zero reward)."""


def _boxed(text: str) -> str | None:
    """The content of the last `\\boxed{...}`, braces balanced; None if there is none."""
    start = text.rfind(BOXED)
    if start < 0:
        return None
    depth, i = 1, start + len(BOXED)
    for j in range(i, len(text)):
        depth += {"{": 1, "}": -1}.get(text[j], 0)
        if depth == 0:
            return text[i:j]
    return None


def extract_answer(text: str, order: Sequence[Extraction] = DEFAULT_EXTRACT) -> str | None:
    """The answer in `text` by the first extraction in `order` that finds one: the first
    `<answer>` tag, the last `\\boxed{}`, or the last number. None: no answer (not well
    formed)."""
    for way in order:
        if way == "tags":
            match = ANSWER_TAG_RE.search(text)
            if match:
                return match.group(1).strip()
        elif way == "boxed":
            boxed = _boxed(text)
            if boxed is not None:
                return boxed.strip()
        else:
            numbers = NUMBER_RE.findall(text)
            if numbers:
                return numbers[-1]
    return None


def normalize(answer: object) -> str:
    """Case, whitespace and number formatting folded: `" 1,000.0 "` -> `"1000"`."""
    text = " ".join(str(answer).split()).lower().rstrip(".")
    plain = text.replace(",", "").replace("$", "")
    try:
        number = float(plain)
    except ValueError:
        return text
    return str(int(number)) if number.is_integer() else repr(number)


def math_equivalent(predicted: str, gold: object) -> bool:
    """`predicted` and `gold` are the same mathematics, by math-verify (parse both, verify)."""
    try:
        from math_verify import parse, verify
    except ImportError as exc:  # pragma: no cover - a declared dependency
        raise ImportError("math_equal needs math-verify: pip install 'math-verify>=0.9'") from exc

    def wrapped(text: str) -> list[Any]:
        # math-verify finds expressions in LaTeX delimiters; a bare answer gets them
        return list(parse(text if "$" in text or "\\" in text else f"${text}$"))

    gold_parsed, pred_parsed = wrapped(str(gold)), wrapped(predicted)
    return bool(gold_parsed and pred_parsed and verify(gold_parsed, pred_parsed))


@dataclass(frozen=True)
class AnswerReward:
    """1.0 when the extracted answer matches the row's `answer_column`; `partial` when
    one was extracted but it is wrong; 0.0 when none was. `math`: compare with math-verify
    instead of normalised strings."""

    extract: tuple[Extraction, ...] = DEFAULT_EXTRACT
    partial: float = 0.0
    math: bool = False
    answer_column: str = "answer"

    def __call__(self, completion: str, row: Mapping[str, Any]) -> float:
        if self.answer_column not in row:
            raise KeyError(
                f"the row has no {self.answer_column!r} column (columns: {sorted(row)}); "
                "name the gold answer's column or write a reward of your own"
            )
        predicted = extract_answer(completion, self.extract)
        if predicted is None:
            return 0.0
        gold = row[self.answer_column]
        same = math_equivalent(predicted, gold) if self.math else normalize(predicted) == normalize(gold)
        return 1.0 if same else self.partial


def make_answer_reward(
    extract: Sequence[Extraction] = DEFAULT_EXTRACT, partial: float = 0.0, math: bool = False,
    answer_column: str = "answer",
) -> AnswerReward:
    return AnswerReward(tuple(extract), partial, math, answer_column)


exact_match = AnswerReward()
math_equal = AnswerReward(math=True)


def well_formed(completion: str, extract: Sequence[Extraction] = DEFAULT_EXTRACT) -> bool:
    """An answer can be extracted from the completion (what `jetctl eval` counts)."""
    return extract_answer(completion, extract) is not None


def _wants_messages(fn: Callable[..., Any]) -> bool:
    try:
        params = inspect.signature(fn).parameters
    except (TypeError, ValueError):
        return False
    return "messages" in params


def score(
    fn: Callable[..., Any], completion: str, row: Mapping[str, Any],
    messages: list[dict[str, Any]], timeout_s: float,
) -> float | dict[str, float]:
    """Call the reward (sync in a worker thread, async in its own loop) within `timeout_s`;
    a number or a role -> number mapping comes back. Raises `RewardError` on a raise, a
    timeout or a value that is neither."""
    kwargs: dict[str, Any] = {"messages": messages} if _wants_messages(fn) else {}

    def call() -> Any:
        out = fn(completion, dict(row), **kwargs)
        if inspect.isawaitable(out):
            async def bounded() -> Any:
                return await out
            return asyncio.run(bounded())
        return out

    # a daemon thread, not an executor: a reward that never returns must not hold up the
    # exit of the process (an executor's workers are joined at exit)
    outcome: dict[str, Any] = {}

    def run() -> None:
        try:
            outcome["value"] = call()
        except Exception as exc:  # noqa: BLE001  # re-raised below as the rollout's failure
            outcome["error"] = exc

    worker = threading.Thread(target=run, name="reward", daemon=True)
    worker.start()
    worker.join(timeout_s)
    if worker.is_alive():
        raise RewardError(f"the reward {_name(fn)} ran past reward_timeout_s={timeout_s:g}")
    if "error" in outcome:
        exc = outcome["error"]
        raise RewardError(f"the reward {_name(fn)} raised {type(exc).__name__}: {exc}") from exc
    raw = outcome["value"]
    if isinstance(raw, Mapping):
        return {str(role): float(value) for role, value in raw.items()}
    if isinstance(raw, (int, float)) and not isinstance(raw, bool):
        return float(raw)
    raise RewardError(
        f"the reward {_name(fn)} returned {type(raw).__name__}: return a number or a "
        "mapping role -> number"
    )


def _name(fn: Callable[..., Any]) -> str:
    return getattr(fn, "__qualname__", type(fn).__name__)
