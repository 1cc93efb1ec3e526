"""The study's optional planner: a model that reads the trials so far and proposes the next.

    planner:                                  # in the study file; off when absent
      base_url: http://127.0.0.1:8000/v1      # any OpenAI-compatible endpoint
      model: qwen2.5-7b-instruct
      api_key_env: PLANNER_API_KEY            # the variable holding the key, never the key
      after_trials: 2                         # the sampler picks until this many have ended

Before the runner asks Optuna for a trial (jetctl/research/runner.py), and once
`after_trials` trials have ended, it asks the planner: one chat completion whose messages
give the hypothesis, the metric and its direction, the search space, and every trial so
far (its values, its outcome, the metric it reached). The reply must hold one JSON object,
`{"values": {<every path of the space>: value}, "reasoning": "..."}`. The values are checked
against the space (each path present, no other; a number within [low, high], an int for
`int`, one of `choices`); a proposal that passes is enqueued in Optuna's storage, so the
trial that runs next takes exactly those values and the study's state stays where it was.
Anything else (no reply within `timeout_s`, no JSON, a value outside the space) is logged
with its reason and the sampler picks instead: the planner can only choose among values
the study already allows, and its reply is parsed as JSON, never run.

Every exchange goes to `<study dir>/planner.jsonl` (the study log): the time, the trial
number it was for, the values proposed or the reason refused, the reasoning and the raw
reply. The trial keeps the reasoning as its user attribute `planner`, which the report
shows beside the trial.
"""

from __future__ import annotations

import json
import logging
import math
import os
import re
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from jetctl.research.study import Param, PlannerConfig, Study

log = logging.getLogger("jetctl.research.planner")

SYSTEM = (
    "You plan the next trial of a reinforcement-learning hyperparameter study. Read the "
    "hypothesis, the metric, the search space and the trials so far, then reply with exactly "
    'one JSON object: {"values": {<every parameter path>: <value>}, "reasoning": "<one '
    'paragraph: why these values>"}. Every value must lie in its parameter\'s range or '
    "choices. Prefer values that test the hypothesis and that the trials so far have not tried."
)


class PlanError(ValueError):
    """A reply the study cannot use; the message says why."""


@dataclass(frozen=True)
class Proposal:
    values: dict[str, Any]
    reasoning: str


def describe_space(space: dict[str, Param]) -> list[dict[str, Any]]:
    out: list[dict[str, Any]] = []
    for path, p in space.items():
        if p.type == "categorical":
            out.append({"path": path, "type": "categorical", "choices": p.choices})
        else:
            out.append({"path": path, "type": p.type, "low": p.low, "high": p.high,
                        **({"note": "sampled on a log scale"} if p.type == "log" else {})})
    return out


def messages(study: Study, trials: list[dict[str, Any]]) -> list[dict[str, str]]:
    """The chat: `trials` as `{"number", "values", "outcome", "metric"}`, oldest first."""
    spec = study.spec
    body = {
        "hypothesis": spec.hypothesis.statement,
        "metric": spec.metric.label,
        "direction": spec.metric.direction,
        "space": describe_space(spec.space),
        "trials_so_far": trials,
        "trials_left": max(0, spec.budget.trials - len(trials)),
    }
    return [{"role": "system", "content": SYSTEM},
            {"role": "user", "content": json.dumps(body, indent=1)}]


def parse_proposal(text: str, space: dict[str, Param]) -> Proposal:
    """The reply's JSON object, checked against the space; `PlanError` says what is wrong."""
    obj = _first_object(text)
    values = obj.get("values")
    if not isinstance(values, dict):
        raise PlanError('the reply has no "values" object')
    missing = [p for p in space if p not in values]
    extra = [p for p in values if p not in space]
    if missing or extra:
        raise PlanError("values must name every parameter of the space and no other"
                        + (f"; missing: {', '.join(missing)}" if missing else "")
                        + (f"; not in the space: {', '.join(map(str, extra))}" if extra else ""))
    checked = {path: _check(path, values[path], p) for path, p in space.items()}
    reasoning = obj.get("reasoning", "")
    return Proposal(checked, reasoning if isinstance(reasoning, str) else json.dumps(reasoning))


def _first_object(text: str) -> dict[str, Any]:
    """The first JSON object in `text` (a bare reply, or one in a ``` fence, or after prose)."""
    decoder = json.JSONDecoder()
    for match in re.finditer(r"\{", text):
        try:
            obj, _ = decoder.raw_decode(text, match.start())
        except json.JSONDecodeError:
            continue
        if isinstance(obj, dict):
            return obj
    raise PlanError("the reply holds no JSON object")


def _check(path: str, value: Any, p: Param) -> Any:
    if p.type == "categorical":
        if value not in (p.choices or []):
            raise PlanError(f"{path} = {value!r}: not one of the choices {p.choices}")
        return value
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
        raise PlanError(f"{path} = {value!r}: a number is needed")
    assert p.low is not None and p.high is not None
    if p.type == "int":
        if float(value) != int(value):
            raise PlanError(f"{path} = {value!r}: an integer is needed")
        value = int(value)
    if not p.low <= value <= p.high:
        raise PlanError(f"{path} = {value!r}: outside [{p.low:g}, {p.high:g}]")
    return value if p.type == "int" else float(value)


class Planner:
    """Asks the endpoint for one proposal per call; logs every exchange to `log_path`."""

    def __init__(self, cfg: PlannerConfig, log_path: Path) -> None:
        self.cfg = cfg
        self.log_path = log_path
        self.api_key = "none"  # many local endpoints take any key
        if cfg.api_key_env is not None:
            key = os.environ.get(cfg.api_key_env)
            if not key:
                raise RuntimeError(f"planner.api_key_env names {cfg.api_key_env}, which is not set: "
                                   f"export {cfg.api_key_env}=... or remove planner.api_key_env")
            self.api_key = key

    def propose(self, study: Study, trials: list[dict[str, Any]], for_trial: int) -> Proposal | None:
        """A checked proposal, or None (the reason logged) when the sampler should pick."""
        record: dict[str, Any] = {"time": time.time(), "trial": for_trial,
                                  "model": self.cfg.model, "trials_seen": len(trials)}
        reply = ""
        try:
            reply = self._complete(messages(study, trials))
            proposal = parse_proposal(reply, study.spec.space)
        except Exception as err:  # noqa: BLE001 - any failure: the sampler picks, logged
            record.update(error=f"{type(err).__name__}: {err}", reply=reply[:4000])
            self._log(record)
            log.warning("planner: no usable proposal for trial %d (%s); the sampler picks",
                        for_trial, record["error"])
            return None
        record.update(values=proposal.values, reasoning=proposal.reasoning, reply=reply[:4000])
        self._log(record)
        return proposal

    def _complete(self, chat: list[dict[str, str]]) -> str:
        from openai import OpenAI

        client = OpenAI(base_url=self.cfg.base_url, api_key=self.api_key,
                        timeout=self.cfg.timeout_s, max_retries=0)
        resp = client.chat.completions.create(
            model=self.cfg.model, messages=chat,  # type: ignore[arg-type]
            max_tokens=self.cfg.max_tokens, temperature=self.cfg.temperature)
        return resp.choices[0].message.content or ""

    def _log(self, record: dict[str, Any]) -> None:
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        with self.log_path.open("a", encoding="utf-8") as f:
            f.write(json.dumps(record, default=str) + "\n")
