"""The explorer's answers (JSON and HTML) and `jetctl trace` on a small run dir written by the
store's and the spool's own write APIs (tests/view/conftest.py)."""

from __future__ import annotations

import json
import re

import pytest
from fastapi.testclient import TestClient
from typer.testing import CliRunner

from jetctl.cli.main import build_app
from jetctl.view.app import make_app
from tests.view.conftest import SEARCHED, ViewRun

pytestmark = pytest.mark.unit


@pytest.fixture(scope="module")
def client(view_run: ViewRun) -> TestClient:
    return TestClient(make_app(view_run.dir, token=None))


def ids(client: TestClient, query: str = "") -> set[str]:
    r = client.get("/api/groups" + query)
    assert r.status_code == 200, r.text
    return {g["id"] for g in r.json()}


def test_filters_pick_the_groups_a_user_asked_for(client: TestClient, view_run: ViewRun) -> None:
    v = view_run
    everything = {v.trained.id, v.flat.id, v.stale.id, v.buffered.id, v.forgotten.id}
    assert ids(client) == everything
    assert ids(client, "?fate=stale") == {v.stale.id}
    assert ids(client, "?fate=trained") == {v.trained.id, v.flat.id, v.forgotten.id}
    assert ids(client, "?reward_min=0.9") == {v.flat.id}  # mean rewards 0.5, 1, .25, .125, .5
    assert ids(client, "?reward_max=0.2") == {v.buffered.id}
    assert ids(client, "?version_min=1&version_max=1") == {v.trained.id, v.flat.id}
    assert ids(client, "?step=2") == {v.trained.id}
    assert ids(client, "?revision=r0") == everything and ids(client, "?revision=r9") == set()
    assert ids(client, "?task=nope") == set()
    # full-text search decodes completions with the run's tokenizer (payloads only)
    assert ids(client, "?search=" + SEARCHED.split()[0].upper()) == {v.buffered.id}
    assert client.get("/api/groups?reward_min=x").status_code == 400


def test_a_group_shows_members_turns_tokens_advantage_and_mask(
    client: TestClient, view_run: ViewRun
) -> None:
    g = client.get(f"/api/group/policy/{view_run.trained.id}").json()
    assert g["fate"] == "trained at step 2" and g["lag"] == 1 and not g["zero_variance"]
    # GRPO: (r - mean) / (std + 1e-6) with std = 0.5 for rewards (0, 1)
    assert [m["advantage"] for m in g["members"]] == pytest.approx([-1.0, 1.0], abs=1e-5)
    assert [m["trained"] for m in g["members"]] == [True, True]
    assert [[t["completion_tokens"] for t in m["turns"]] for m in g["members"]] == [[2, 3], [2]]
    assert [t["version"] for t in g["members"][0]["turns"]] == [1, 2]
    page = client.get(f"/group/policy/{view_run.trained.id}").text
    first, second = page.split("<div class='member'")[1:]
    assert first.count("<span class='tok'") == 5 and second.count("<span class='tok'") == 2
    assert "tool results / environment</b> (2 tokens)" in first and "(tool call)" in first
    assert "title='logprob -5.000'" in first and "model version 2" in first

    flat = client.get(f"/api/group/policy/{view_run.flat.id}").json()
    assert flat["zero_variance"] and [m["trained"] for m in flat["members"]] == [False, False]
    assert "skipped for zero variance" in client.get(f"/group/policy/{view_run.flat.id}").text
    gone = client.get(f"/group/policy/{view_run.forgotten.id}").text
    assert "no longer stored" in gone and view_run.forgotten.trajectories[0].id in gone
    assert client.get("/group/policy/no-such-group").status_code == 404


def test_overview_curves_fates_staleness_and_step_links(
    client: TestClient, view_run: ViewRun
) -> None:
    o = client.get("/api/overview/policy").json()
    digits = o["tasks"]["digits"]
    assert digits["fates"] == {"trained": 3, "stale": 1, "buffered": 1}
    # reward per step: step 1 = forgotten (0.5) and flat (1.0), step 2 = trained (0.5)
    assert [(p["step"], p["reward"]) for p in digits["curve"]] == [(1, 0.75), (2, 0.5)]
    # step - oldest version: flat 1 - 1, forgotten 1 - 0, trained 2 - 1
    assert digits["staleness"] == {"0": 1, "1": 2}
    assert o["skipped_share"] == pytest.approx(1 / 3)  # 1 skipped, 2 used in the step log
    page = client.get("/").text
    assert "href='/step/policy/2'" in page and page.count("<tr class='group'") == 5
    step = client.get("/step/policy/2").text
    assert step.count("<tr class='group'") == 1 and view_run.trained.id in step


def test_trace_answers_for_a_trained_a_stale_and_a_failed_trajectory(
    client: TestClient, view_run: ViewRun
) -> None:
    trained = client.get(f"/api/trace/{view_run.trained.trajectories[0].id}").json()
    assert (trained["step"], trained["checkpoint"]) == (2, "step-00000002")
    assert trained["versions"] == [1, 2] and trained["node"] == "digits-0"
    assert (trained["task_id"], trained["revision"], trained["verdict"]) == ("t0", "r0",
                                                                            "accepted")
    stale = client.get(f"/api/trace/{view_run.stale.trajectories[1].id}").json()
    assert stale["step"] is None and stale["verdict"] == (
        "refused as stale at Submit: stale: lag 3 > max_staleness 2")
    failed = client.get(f"/api/trace/{view_run.failed_id}").json()
    assert failed["status"] == "dropped (failed)" and failed["node"] == "digits-0"
    assert failed["error"] == "ValueError: the env crashed" and failed["group"] is None
    old = client.get(f"/api/trace/{view_run.forgotten.trajectories[0].id}").json()
    assert old["step"] == 1 and old["checkpoint"] == "step-00000002"  # first holding step 1
    assert any("no longer stored" in n for n in old["notes"]) and old["versions"] == []
    page = client.get(f"/trace/{view_run.trained.trajectories[0].id}").text
    assert "<a class='step-link' href='/step/policy/2'>2</a>" in page


def test_jetctl_trace_prints_the_lineage_and_refuses_an_unknown_id(view_run: ViewRun) -> None:
    runner = CliRunner()
    tid = view_run.trained.trajectories[0].id
    out = runner.invoke(build_app(), ["trace", tid, str(view_run.dir)])
    assert out.exit_code == 0, out.output
    assert re.search(r"step\s+2\n\s+checkpoint step-00000002", out.output), out.output
    as_json = runner.invoke(build_app(), ["trace", view_run.failed_id, str(view_run.dir),
                                          "--json"])
    assert json.loads(as_json.output)["status"] == "dropped (failed)"
    missing = runner.invoke(build_app(), ["trace", "nope", str(view_run.dir)])
    assert missing.exit_code == 1 and "holds trajectory nope" in missing.output


def test_the_runs_token_is_required_when_set(view_run: ViewRun) -> None:
    guarded = TestClient(make_app(view_run.dir, token="s3cret"))
    assert guarded.get("/").status_code == 401
    assert guarded.get("/api/groups", headers={"Authorization": "Bearer wrong"}).status_code == 401
    assert guarded.get("/api/groups", headers={"Authorization": "Bearer s3cret"}).status_code == 200
    assert guarded.get("/?token=s3cret").status_code == 200
    assert guarded.get("/api/groups").status_code == 200  # the cookie it set
