"""The study's planner (jetctl/research/planner.py) against a real HTTP endpoint that speaks
the OpenAI chat-completions API with scripted replies (a fake model, a real server, the
real `openai` client), and real Optuna sqlite storage; no trial processes."""

from __future__ import annotations

import json
import threading
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

import pytest

from jetctl.research.planner import PlanError, parse_proposal
from jetctl.research.report import render_markdown, trial_rows
from jetctl.research.runner import StudyRunner, _suggest, storage_url
from jetctl.research.study import StudyError, load_study

pytestmark = pytest.mark.unit

ROOT = Path(__file__).resolve().parents[2]
LR = "models.policy.optimizer.lr"
GPS = "models.policy.train.groups_per_step"

STUDY = """\
study: {{name: planned, recipe: {recipe}}}
hypothesis: {{statement: a planner finds a good rate, metric_at_least: 0.5}}
metric: {{key: reward/mean, last_steps: 2}}
budget: {{trials: 4, max_steps: 3}}
search: {{sampler: {sampler}, pruner: none}}
space:
  {lr}: {{type: log, low: 1.0e-4, high: 1.0e-2}}
  {gps}: {{type: int, low: 1, high: 4}}
planner:
  base_url: {url}
  model: scripted
  api_key_env: TEST_PLANNER_KEY
  after_trials: 1
"""


class Endpoint:
    """POST /v1/chat/completions answers with the next scripted content; keeps each request."""

    def __init__(self) -> None:
        self.replies: list[str] = []
        self.requests: list[tuple[dict[str, str], dict[str, Any]]] = []
        endpoint = self

        class Handler(BaseHTTPRequestHandler):
            def do_POST(self) -> None:
                body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
                endpoint.requests.append(({k.lower(): v for k, v in self.headers.items()}, body))
                content = endpoint.replies.pop(0)
                out = json.dumps({
                    "id": "c1", "object": "chat.completion", "created": 0, "model": "scripted",
                    "choices": [{"index": 0, "finish_reason": "stop",
                                 "message": {"role": "assistant", "content": content}}],
                    "usage": {"prompt_tokens": 1, "completion_tokens": 1, "total_tokens": 2},
                }).encode()
                self.send_response(200)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(out)))
                self.end_headers()
                self.wfile.write(out)

            def log_message(self, *args: Any) -> None:
                pass

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.server.server_port}/v1"
        threading.Thread(target=self.server.serve_forever, daemon=True).start()


@pytest.fixture
def endpoint() -> Iterator[Endpoint]:
    e = Endpoint()
    yield e
    e.server.shutdown()


def _study(tmp_path: Path, url: str, sampler: str = "random") -> Path:
    file = tmp_path / "planned.yaml"
    file.write_text(STUDY.format(recipe=ROOT / "recipes" / "tiny.yaml", url=url, lr=LR, gps=GPS,
                                 sampler=sampler))
    return file


def test_a_proposal_is_checked_against_the_space(tmp_path: Path) -> None:
    space = load_study(_study(tmp_path, "http://127.0.0.1:1/v1")).spec.space
    def say(values: dict[str, object]) -> str:
        return json.dumps({"values": values})

    fenced = json.dumps({"values": {LR: 0.002, GPS: 3}, "reasoning": "between the two best"})
    good = parse_proposal(f"Here it is:\n```json\n{fenced}\n```", space)
    assert good.values == {LR: 0.002, GPS: 3} and good.reasoning == "between the two best"
    for reply, why in [
        ("no json here", "no JSON object"),
        (say({LR: 0.002}), f"missing: {GPS}"),
        (say({LR: 0.002, GPS: 2, "run.name": "x"}), "not in the space: run.name"),
        (say({LR: 0.5, GPS: 2}), "outside [0.0001, 0.01]"),
        (say({LR: 0.002, GPS: 2.5}), "an integer is needed"),
        (say({LR: "__import__('os')", GPS: 2}), "a number is needed"),
        (say({LR: True, GPS: 2}), "a number is needed"),
    ]:
        with pytest.raises(PlanError, match=why.replace("[", r"\[").replace("(", r"\(")):
            parse_proposal(reply, space)


def test_the_planner_reads_the_trials_and_its_proposal_runs_next(
    tmp_path: Path, endpoint: Endpoint, monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setenv("TEST_PLANNER_KEY", "sk-test-123")
    study = load_study(_study(tmp_path, endpoint.url))
    study_dir = tmp_path / "planned"
    said: list[str] = []
    runner = StudyRunner(study, study_dir, parallel=1, say=said.append)

    assert runner.plan_next() is False  # no trial has ended: the sampler picks the first
    assert endpoint.requests == []
    first = runner.optuna_ask()
    first_values = _suggest(first, study)
    first.set_user_attr("metric", 0.25)
    first.set_user_attr("outcome", "completed")
    runner.ostudy.tell(first, 0.25)

    endpoint.replies.append(json.dumps({"values": {LR: 0.003, GPS: 2},
                                        "reasoning": "try a larger rate with two groups"}))
    assert runner.plan_next() is True
    headers, body = endpoint.requests[0]
    assert headers["authorization"] == "Bearer sk-test-123" and body["model"] == "scripted"
    asked = json.loads(body["messages"][1]["content"])
    assert asked["trials_so_far"] == [{"number": 0, "values": first_values,
                                       "outcome": "completed", "metric": 0.25}]
    assert [p["path"] for p in asked["space"]] == [LR, GPS]
    second = runner.optuna_ask()
    assert _suggest(second, study) == {LR: 0.003, GPS: 2}  # exactly the proposal
    runner.ostudy.tell(second, 0.6)

    endpoint.replies.append(json.dumps({"values": {LR: 0.5, GPS: 2}, "reasoning": "bigger"}))
    assert runner.plan_next() is False  # outside the space: refused, the sampler picks
    third = _suggest(runner.optuna_ask(), study)
    assert 1e-4 <= third[LR] <= 1e-2 and third != {LR: 0.5, GPS: 2}

    log = [json.loads(line) for line in (study_dir / "planner.jsonl").read_text().splitlines()]
    assert [r["trial"] for r in log] == [1, 2]
    assert log[0]["values"] == {LR: 0.003, GPS: 2}
    assert log[0]["reasoning"] == "try a larger rate with two groups"
    assert "outside [0.0001, 0.01]" in log[1]["error"] and "values" not in log[1]
    assert any("planner proposed trial 1" in s for s in said)
    assert any("no usable proposal for trial 2" in s for s in said)
    assert "sk-test-123" not in (study_dir / "planner.jsonl").read_text()

    report = render_markdown(study, trial_rows(storage_url(study_dir), study.name))
    assert "## Proposed by the planner" in report
    assert "- trial 1 (lr=0.003, groups_per_step=2): try a larger rate with two groups" in report


def test_an_unreachable_planner_leaves_the_choice_to_the_sampler(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setenv("TEST_PLANNER_KEY", "k")
    study = load_study(_study(tmp_path, "http://127.0.0.1:9/v1"))  # discard port: refused
    runner = StudyRunner(study, tmp_path / "planned", parallel=1, say=lambda s: None)
    trial = runner.optuna_ask()
    _suggest(trial, study)
    runner.ostudy.tell(trial, 0.1)
    assert runner.plan_next() is False
    log = (tmp_path / "planned" / "planner.jsonl").read_text()
    assert "APIConnectionError" in log


def test_planner_settings_that_cannot_work_are_refused(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
) -> None:
    file = _study(tmp_path, "http://127.0.0.1:1/v1", sampler="grid")
    with pytest.raises(StudyError, match="nothing to plan"):
        load_study(file)
    file.write_text(file.read_text().replace("base_url: http://", "base_url: ftp://")
                    .replace("sampler: grid", "sampler: tpe"))
    with pytest.raises(StudyError, match="base_url"):
        load_study(file)
    monkeypatch.delenv("TEST_PLANNER_KEY", raising=False)
    study = load_study(_study(tmp_path, "http://127.0.0.1:1/v1"))
    with pytest.raises(RuntimeError, match="TEST_PLANNER_KEY, which is not set"):
        StudyRunner(study, tmp_path / "planned", parallel=1)
