"""A dataset task through the real swarm, then `jetctl eval` and `jetctl export` on its run.

`jetctl up --detach` (controller, a builtin:tiny server, two client nodes running the
built-in dataset env and chat agent over a JSONL file), until the server has a checkpoint
at step 2; `jetctl down`; then `jetctl eval RUN_DIR --checkpoint base,latest --json` scores
the held-out rows with the checkpoint, and `jetctl export --merged` writes a folder that
transformers loads. The reward (the reply's length, mod 3) varies within a group, so
groups carry signal and the server steps.
"""

from __future__ import annotations

import json
import time
from pathlib import Path
from typing import Any

import pytest

from jetctl.rundir import RunPaths
from tests.runs import detached_run, jetctl

pytestmark = [pytest.mark.integration, pytest.mark.timeout(600)]

RECIPE = """\
# jetctl up {recipe}
run: {{name: dataset-e2e, duration_s: 400}}
models:
  policy:
    model: builtin:tiny
    finetune: full
    optimizer: {{lr: 2.0e-3}}
    train: {{groups_per_step: 2, max_staleness: 4}}
    checkpoint: {{every_steps: 2}}
tasks:
  rows:
    env: jetctl.envs.dataset:make_env
    agent: jetctl.envs.dataset:chat_agent
    model: policy
    clients: 2
    group_size: 4
    concurrency: 4
    sampling: {{max_tokens: 4}}
    env_args: {{path: {data}, test_fraction: 0.25, reward: "tests.test_dataset_swarm:length_mod_3"}}
"""


def length_mod_3(completion: str, row: dict[str, Any]) -> float:
    return float(len(completion) % 3) / 2


def test_a_dataset_task_trains_and_its_checkpoint_is_evaluated_and_exported(tmp_path: Path) -> None:
    data = tmp_path / "rows.jsonl"
    data.write_text("".join(json.dumps({"prompt": f"reply with {i % 10}", "answer": i % 10}) + "\n"
                            for i in range(40)))
    recipe = tmp_path / "r.yaml"
    recipe.write_text(RECIPE.format(recipe=recipe, data=data))
    run_dir = tmp_path / "run"
    checkpoints = RunPaths(run_dir).checkpoints("policy")
    with detached_run(recipe, run_dir):
        deadline = time.monotonic() + 300
        while time.monotonic() < deadline and not list(checkpoints.glob("step-*/manifest.json")):
            time.sleep(0.5)
    assert list(checkpoints.glob("step-*/manifest.json")), "no checkpoint within 300 s"
    nodes = [json.loads(p.read_text()) for p in RunPaths(run_dir).nodes.glob("*.json")]
    assert sum(n["groups_spooled"] for n in nodes) > 0

    out = jetctl("eval", str(run_dir), "--checkpoint", "base,latest", "--samples", "2", "--json")
    report = json.loads(out.stdout)
    assert report["latest"]["rows"]["step"] >= 2
    for label in ("base", "latest"):
        figures = report[label]["rows"]
        assert (figures["rows"], figures["failed"]) == (10, 0)
        assert 0 <= figures["mean_reward"] <= 1

    exported = tmp_path / "merged"
    jetctl("export", str(run_dir), "--out", str(exported), "--merged")
    from transformers import AutoModelForCausalLM

    assert AutoModelForCausalLM.from_pretrained(exported) is not None
    card = (exported / "README.md").read_text()
    step = report["latest"]["rows"]["step"]
    assert f"| step-{step} | test | rows | " in card and "| base | test | rows | " in card
