"""The cost ledger in a real run (`jetctl up --detach`: controller, a builtin:tiny server, a
client node): an env whose sessions report spend (`jetctl.env.Spending.cost`) has it carried
with each trajectory to the server and summed into the step rows, and the finished run's
`jetctl status --json` and summary line show the total.

Each rollout of `PaidDigitsEnv` reports PRICE dollars of kind "judge" when its session
closes, so a step row's `cost/usd` is PRICE times the trajectories the step consumed
(trained on or skipped without signal), to rounding. Its reward is the share of the reply
that is digits, any digit (the digits env's asks for one): the untrained builtin:tiny puts
~1.4% on a digit token, so about one group of 4 in five carries signal and the rest are
skipped, and a step comes after ~10 groups instead of the ~100 one digit takes. The first
rollout of the run (across its processes: a marker file) fails in `reward()` after its
session spent: its spend is the task's waste, apart from the spend that trained.
"""

from __future__ import annotations

import json
import os
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

from envs.digits.env import DigitsEnv, DigitsSession
from jetctl.env import Spending, Task
from jetctl.rundir import RunPaths
from tests.runs import detached_run, jetctl, step_rows

PRICE = 0.0025  # dollars per rollout, exact in binary to a few ulps over a few hundred sums
STEPS = 3

RECIPE = """\
run: {name: costs, duration_s: 400}
models:
  policy:
    model: builtin:tiny
    finetune: full
    optimizer: {lr: 2.0e-3}
    train: {groups_per_step: 2, max_staleness: 4}
tasks:
  digits:
    env: tests.test_costs_run:make_env
    env_args: {marker: MARKER}
    agent: agents.digits:agent
    model: policy
    clients: 1
    group_size: 4
    sampling: {max_tokens: 4}
"""


@dataclass
class PaidDigitsSession(DigitsSession, Spending):
    marker: str = ""  # the first rollout to create this file fails in reward()

    def reward(self) -> float:
        try:
            os.close(os.open(self.marker, os.O_CREAT | os.O_EXCL | os.O_WRONLY))
        except FileExistsError:
            chars = [c for c in self.submitted or "" if not c.isspace()]
            digits = sum(c.isdigit() for c in chars)
            return digits / max(int(self.task.data["length"]), len(chars)) if chars else 0.0
        raise RuntimeError("the judge failed (deliberately, once per run)")

    def close(self) -> None:  # a judge paid once per rollout, reported as it closes
        self.cost(usd=PRICE, kind="judge")
        super().close()


@dataclass
class PaidDigitsEnv(DigitsEnv):
    marker: str = ""

    def open(self, task: Task) -> PaidDigitsSession:
        return PaidDigitsSession(task, marker=self.marker)


def make_env(marker: str = "") -> PaidDigitsEnv:
    return PaidDigitsEnv(marker=marker)


@pytest.mark.integration
@pytest.mark.timeout(400)
def test_the_spend_an_env_reports_reaches_the_step_rows_and_the_runs_status(
    tmp_path: Path,
) -> None:
    recipe = tmp_path / "r.yaml"
    recipe.write_text(RECIPE.replace("MARKER", str(tmp_path / "failed-once")))
    live: dict[str, Any] = {}
    with detached_run(recipe, tmp_path / "run") as run_dir:
        deadline = time.monotonic() + 240
        while time.monotonic() < deadline and len(step_rows(run_dir)) < STEPS:
            time.sleep(0.5)
        with ThreadPoolExecutor(2) as pool:  # the two views of the live run, side by side
            as_json = pool.submit(jetctl, "status", "--once", "--json", "--run-dir",
                                  str(run_dir), check=False)
            as_text = pool.submit(jetctl, "status", "--once", "--run-dir", str(run_dir),
                                  check=False)
            out, text_live = as_json.result(), as_text.result().stdout
        if out.returncode == 0:
            live = json.loads(out.stdout)
    rows = step_rows(run_dir)
    assert len(rows) >= STEPS, f"{len(rows)} step rows within 240 s"
    for row in rows:
        consumed = row["trajectories"] + row["trajectories/skipped"]
        assert row["cost/usd"] == pytest.approx(PRICE * consumed, rel=1e-9)
        assert row["cost/usd/judge"] == row["cost/usd"]
        assert row["cost/client_by_task"]["digits"]["usd/judge"] == pytest.approx(row["cost/usd"])
        # every rollout process burns some CPU (imports are in the forkserver: not much)
        assert row["cost/client_cpu_s"] > 0 and row["cost/env_s"] >= 0

    # live, the running server's step log so far: at least STEPS rows, all priced the same
    assert live, "jetctl status --once --json failed while the run was up"
    now = live["costs"]["policy"]
    assert now["steps"] >= STEPS and now["usd_by_kind"]["judge"] == pytest.approx(now["usd"])
    assert now["usd"] >= PRICE * 4 * STEPS * (1 - 1e-9)  # >= one group of 4 a step
    assert "cost policy: server CPU" in text_live and "env spend $" in text_live, text_live
    assert live["waste"]["digits"]["trajectories"] >= 1, "the failed rollout, as its node synced"
    assert "waste digits: " in text_live, text_live

    with ThreadPoolExecutor(2) as pool:  # the finished run's summary, as JSON and as text
        as_json = pool.submit(jetctl, "status", "--once", "--json", "--run-dir", str(run_dir))
        as_text = pool.submit(jetctl, "status", "--once", "--run-dir", str(run_dir))
        summary, text = json.loads(as_json.result().stdout), as_text.result().stdout
    costs = summary["models"]["policy"]["costs"]
    # waste: every trajectory the node dropped (the deliberate failure, and any other failed
    # or timed-out rollout, or ok one in a dropped group), each of which spent PRICE but a
    # timed-out one (killed before it reports)
    nodes = [json.loads(p.read_text()) for p in RunPaths(run_dir).nodes.glob("*.json")]
    dropped = {r: sum(n["dropped"].get(r, 0) for n in nodes) for r in ("failed", "timeout")}
    waste = summary["waste"]["digits"]
    assert waste["trajectories"] == dropped["failed"] + dropped["timeout"] >= 1
    assert waste["usd/judge"] == pytest.approx(PRICE * dropped["failed"], rel=1e-9)
    assert waste["client_cpu_s"] > 0 and waste["rollout_s"] > 0
    total = sum(r["cost/usd"] for r in rows)
    assert costs["usd"] == pytest.approx(total, rel=1e-9)
    assert costs["usd_by_kind"] == {"judge": pytest.approx(total, rel=1e-9)}
    assert costs["tasks"]["digits"]["usd"] == pytest.approx(total, rel=1e-9)
    assert costs["client_cpu_s"] == pytest.approx(sum(r["cost/client_cpu_s"] for r in rows))
    assert f"env spend ${total:.4f} (judge ${total:.4f})" in text, text
    assert (f"waste digits: {int(waste['trajectories'])} trajectories failed, timed out or "
            f"dropped on the nodes" in text), text
