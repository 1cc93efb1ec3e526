"""The cost ledger: a real trainer's step rows (builtin:tiny, a real store) summed into
per-model and per-task costs, and the line the run's summary shows."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
from rich.console import Console

from jetctl.costs import read_costs
from jetctl.rundir import write_json_atomic
from tests.server.trainer_support import config, make_trainer, step, submit

pytestmark = pytest.mark.unit


def test_a_runs_steps_add_up_to_its_costs_and_the_summary_shows_them(tmp_path: Path) -> None:
    trainer = make_trainer(tmp_path, config(finetune="lora"))
    # per step: a group of 3 x 3 completion tokens trained on; before the second step one
    # more group without signal (all rewards equal): generated, consumed, never trained
    submit(trainer, rewards=(0.0, 1.0, 0.5))
    assert step(trainer) is not None
    submit(trainer, rewards=(1.0, 1.0, 1.0))
    submit(trainer, rewards=(0.0, 2.0, 0.5))
    assert step(trainer) is None  # the group without signal consumed: nothing to train yet
    assert step(trainer) is not None
    rows = [json.loads(line) for line in trainer.steps_log.read_text().splitlines()]
    for row in rows:
        assert row["cost/server_cpu_s"] >= row["cost/train_cpu_s"] > 0
        assert row["cost/generate_cpu_s"] == pytest.approx(
            row["cost/server_cpu_s"] - row["cost/train_cpu_s"] - row["cost/publish_cpu_s"])
    assert [r["tokens/generated"] for r in rows] == [9.0, 18.0]
    assert [r["tokens/trained"] for r in rows] == [9.0, 9.0]

    costs = read_costs(trainer.steps_log)
    assert costs is not None and costs.steps == 2
    assert (costs.tokens_generated, costs.tokens_trained) == (27, 18)
    assert costs.server_cpu_s == pytest.approx(sum(r["cost/server_cpu_s"] for r in rows))
    assert costs.tasks["digits"].cpu_s == pytest.approx(costs.server_cpu_s)  # the only task

    # the finished run's summary: one cost line for the model
    from jetctl.run.status import finished_summary, render_summary

    rd = tmp_path / "run"
    recipe = tmp_path / "r.yaml"
    recipe.write_text("run: {name: t}\nmodels:\n  policy: {model: builtin:tiny}\n"
                      "tasks:\n  digits:\n    env: envs.digits:make_env\n"
                      "    agent: agents.digits:agent\n    model: policy\n")
    write_json_atomic(rd / "run.json", {"run": "t", "recipe": str(recipe), "state": "finished",
                                        "servers": {"policy": {}}})
    (rd / "metrics").mkdir()
    shutil.copy(trainer.steps_log, rd / "metrics" / "policy.steps.jsonl")
    # the last syncs of the task's two nodes, as the controller keeps them: one wasted spend
    for name, waste in (("digits-0", {"trajectories": 3.0, "usd/judge": 0.75,
                                      "client_cpu_s": 2.0, "env_s": 0.5, "rollout_s": 9.0}),
                        ("digits-1", {"trajectories": 1.0, "rollout_s": 30.0})):
        write_json_atomic(rd / "nodes" / f"{name}.json", {"task": "digits", "waste": waste})
    summary = finished_summary(rd)
    assert summary["models"]["policy"]["costs"]["tokens_generated"] == 27
    assert summary["waste"] == {"digits": {"client_cpu_s": 2.0, "env_s": 0.5,
                                           "rollout_s": 39.0, "trajectories": 4.0,
                                           "usd/judge": 0.75}}
    console = Console(width=400, record=True)
    console.print(render_summary(summary))
    text = console.export_text()
    assert "cost policy: server CPU" in text and "tokens generated 27, trained 18" in text
    assert ("waste digits: 4 trajectories failed, timed out or dropped on the nodes, or "
            "refused at Submit: client CPU 2.0 s, env 0.5 s, rollouts 39.0 s wall; env spend "
            "$0.7500 (judge $0.7500)" in text)


def test_bench_loop_prints_the_swarms_cost_per_step_beside_its_ratios(tmp_path: Path) -> None:
    """`jetctl bench loop`'s table and JSON: the swarm's ledger per step row (from a real
    trainer's step log), '-' for the loop, which keeps none."""
    from dataclasses import asdict

    from jetctl.bench.loop import figures, render

    trainer = make_trainer(tmp_path, config(finetune="lora"))
    for rewards in ((0.0, 1.0, 0.5), (1.0, 0.0, 2.0)):
        submit(trainer, rewards=rewards)
        assert step(trainer) is not None
    costs = read_costs(trainer.steps_log)
    assert costs is not None
    per = costs.per_step()
    assert per["server_cpu_s_per_step"] == pytest.approx(costs.server_cpu_s / 2)
    assert per["tokens_generated_per_step"] == 9.0  # 3 x 3 completion tokens a step
    assert per["usd_per_step"] == 0.0  # these groups report no spend

    def run(mode: str) -> object:
        groups = [{"t": float(t), "reward": 0.5, "n": 3, "informative": True}
                  for t in range(1, 40)]
        return figures(mode, 0.0, 0, wall_s=40.0, groups=groups, step_times=[10.0, 20.0],
                       train=[], gen_batches=[], staleness=[], cpu_s={})

    loop, swarm = run("loop"), run("swarm")
    swarm.costs = per  # type: ignore[attr-defined]  # as run_swarm sets it after the run
    console = Console(width=250, record=True)
    console.print(render([loop, swarm]))  # type: ignore[list-item]
    lines = console.export_text().splitlines()
    def cells(label: str) -> list[str]:  # figure | loop | swarm | ratio
        rows = [[c.strip() for c in line.strip().strip("│").split("│")] for line in lines]
        return next(r for r in rows if r[0] == label)

    assert cells("server CPU s per step") == [
        "server CPU s per step", "-", f"{per['server_cpu_s_per_step']:.2f}", ""]
    for part in ("train", "generate"):
        key = f"{part}_cpu_s_per_step"
        assert cells(f"{part} CPU s per step")[1:3] == ["-", f"{per[key]:.2f}"], part
    assert cells("tokens generated per step")[1:3] == ["-", "9"]
    # the waste its rows carry (none refused here), and no GPU rows for a trainer on a CPU
    assert cells("refused stale at batch, trajectories per step")[1:3] == ["-", "0.00"]
    assert cells("their env spend $ per step")[1:3] == ["-", "0.0000"]
    assert not any("GPU s per step" in line for line in lines)
    assert asdict(swarm)["costs"]["train_cpu_s_per_step"] == per["train_cpu_s_per_step"]  # type: ignore[call-overload]


def test_a_sessions_spend_adds_up_by_kind_and_a_bad_figure_is_refused() -> None:
    from jetctl.env import Spending, spent

    class Judged(Spending):
        pass

    s = Judged()
    s.cost(usd=0.5, kind="judge")
    s.cost(0.25, "judge")
    s.cost(usd=1)  # kind api by default
    assert spent(s) == {"judge": 0.75, "api": 1.0}
    assert spent(object()) == {}  # a session that reports nothing
    for usd, kind in ((-1.0, "api"), (float("nan"), "api"), (float("inf"), "api"),
                      (1.0, ""), (1.0, "a/b")):
        with pytest.raises(ValueError, match="session.cost"):
            s.cost(usd=usd, kind=kind)
    assert spent(s) == {"judge": 0.75, "api": 1.0}  # the refused figures left nothing


def test_a_rollouts_costs_are_split_over_a_teams_roles_and_summed_per_task() -> None:
    from jetctl.costs import rollout_costs, step_client_costs

    timings = {"open_s": 0.25, "agent_s": 3.0, "reward_s": 0.5, "cpu_s": 1.0, "rollout_s": 4.0}
    one = rollout_costs(timings, {"judge": 0.5})
    assert one == {"usd/judge": 0.5, "client_cpu_s": 1.0, "env_s": 0.75}
    half = rollout_costs(timings, {"judge": 0.5}, roles=2)  # each role's trajectory: half
    assert half == {"usd/judge": 0.25, "client_cpu_s": 0.5, "env_s": 0.375}
    scalars, by_task = step_client_costs(
        [("a", one), ("a", one), ("b", half), ("b", {"usd/api": 2.0})])
    assert scalars == {"cost/usd": 3.25, "cost/usd/api": 2.0, "cost/usd/judge": 1.25,
                       "cost/client_cpu_s": 2.5, "cost/env_s": 1.875}
    assert by_task["a"] == {"client_cpu_s": 2.0, "env_s": 1.5, "usd/judge": 1.0}
    assert step_client_costs([])[0] == {"cost/usd": 0.0, "cost/client_cpu_s": 0.0,
                                        "cost/env_s": 0.0}  # always there for the trackers


@pytest.mark.parametrize("costs, fine", [
    ({"usd/judge": 0.25, "client_cpu_s": 1.5, "env_s": 0.0}, True),
    ({"usd/api": -0.01}, False), ({"usd/api": float("nan")}, False),
    ({"client_cpu_s": float("inf")}, False), ({"usd/api": 2e9}, False),
    ({f"usd/k{i}": 0.0 for i in range(17)}, False),
    ({"usd/" + "k" * 300: 0.1}, False),  # a name past max_id_chars lands in every step row
])
def test_admission_refuses_cost_figures_that_would_corrupt_the_ledger(
    costs: dict[str, float], fine: bool,
) -> None:
    from jetctl.proto.convert import group_to_pb
    from jetctl.server.admission import Limits, check_group
    from tests.factories import make_group

    limits = Limits(model="policy", vocab_size=100, max_context_tokens=64, max_staleness=2)
    g = make_group(version=3)
    g.trajectories[1].costs = costs
    for form in (g, group_to_pb(g)):  # as a dataclass and as Submit's protobuf
        v = check_group(form, limits, 4, frozenset())
        if fine:
            assert v.outcome == "accepted", v.reason
        else:
            assert v.outcome == "invalid" and "costs" in v.reason, v.reason


def test_a_group_refused_stale_at_batch_time_is_the_next_rows_waste(tmp_path: Path) -> None:
    """A group that went stale in the buffer reached the server and bought nothing: its
    trajectories' costs are the next step row's `cost/waste_by_task`, summed in the ledger
    apart from the spend that trained. On a CPU the rows carry no GPU seconds (absent, not 0)."""
    from jetctl.costs import cost_line
    from jetctl.proto.convert import group_to_pb
    from tests.factories import make_group
    from tests.server.trainer_support import PROMPT

    trainer = make_trainer(tmp_path, config(max_staleness=1))
    late = make_group(rewards=(0.0, 1.0), version=0, prompt=PROMPT, completion=(21, 22, 23))
    for t in late.trajectories:
        t.costs = {"usd/judge": 0.25, "client_cpu_s": 1.5, "env_s": 0.5}
    assert trainer.store.put(late, group_to_pb(late).SerializeToString()).result(5).outcome \
        == "accepted"
    (held,) = trainer.store.take(1, timeout_s=0.1)  # waits while two steps happen
    for _ in range(2):
        submit(trainer)
        assert step(trainer) is not None
    trainer.store.give_back([held])
    assert step(trainer) is None  # refused stale at batch time: no step on it
    submit(trainer)
    assert step(trainer) is not None
    rows = [json.loads(line) for line in trainer.steps_log.read_text().splitlines()]
    assert ["cost/waste_by_task" in r for r in rows] == [False, False, True]
    assert rows[2]["cost/waste_by_task"] == {
        "digits": {"client_cpu_s": 3.0, "env_s": 1.0, "trajectories": 2.0, "usd/judge": 0.5}}
    assert rows[2]["cost/usd"] == 0.0, "the trained group reported no spend: waste stays apart"
    assert not any(k.endswith("_gpu_s") for r in rows for k in r), "a CPU has no GPU seconds"

    costs = read_costs(trainer.steps_log)
    assert costs is not None and costs.usd == 0.0
    assert costs.waste == {"client_cpu_s": 3.0, "env_s": 1.0, "trajectories": 2.0,
                           "usd/judge": 0.5}
    assert (costs.train_gpu_s, costs.generate_gpu_s, costs.publish_gpu_s) == (None, None, None)
    line = cost_line("policy", costs.to_json())
    assert "refused stale at batch: 2 trajectories, client CPU 3.0 s, env spend $0.5000" in line
    assert "GPU" not in line


def test_a_rows_gpu_seconds_split_its_wall_interval(tmp_path: Path) -> None:
    """`gpu_split` (a row of a trainer on CUDA; not measured here, no GPU on this host): the
    synchronized step and publish wall seconds, the rest of the row's interval as generate
    (generation and the held device's idle time), never below 0."""
    from jetctl.costs import cost_line, gpu_split

    assert gpu_split(10.0, 3.0, 0.5) == {"cost/train_gpu_s": 3.0, "cost/publish_gpu_s": 0.5,
                                         "cost/generate_gpu_s": 6.5}
    assert gpu_split(1.0, 1.25, 0.0)["cost/generate_gpu_s"] == 0.0  # clocks read apart
    # the ledger of two such rows (written by hand: this host has no GPU to write them)
    base = {"cost/server_cpu_s": 2.0, "cost/train_cpu_s": 1.0, "cost/generate_cpu_s": 0.5,
            "cost/publish_cpu_s": 0.5, "cost/tokens_by_task": {"digits": [9, 9]},
            "reward/mean": 0.5}
    log = tmp_path / "steps.jsonl"
    log.write_text("".join(json.dumps({**base, **gpu_split(10.0, 3.0, 0.5)}) + "\n"
                           for _ in range(2)))
    costs = read_costs(log)
    assert costs is not None
    assert (costs.train_gpu_s, costs.generate_gpu_s, costs.publish_gpu_s) == (6.0, 13.0, 1.0)
    assert "GPU 6.0 s train, 13.0 generate, 1.0 publish" in cost_line("p", costs.to_json())


def test_per_step_carries_the_ledgers_waste_and_its_gpu_seconds_where_there_are_any(
    tmp_path: Path,
) -> None:
    """`Costs.per_step()` (what `jetctl bench loop` prints and writes): the waste the rows
    carry (groups refused stale at batch time) and, on a GPU, its seconds, per step row."""
    from jetctl.costs import gpu_split

    base = {"cost/server_cpu_s": 2.0, "cost/train_cpu_s": 1.0, "cost/generate_cpu_s": 0.5,
            "cost/publish_cpu_s": 0.5, "cost/tokens_by_task": {"digits": [9, 9]},
            "reward/mean": 0.5}
    stale = {"cost/waste_by_task": {"digits": {"trajectories": 2.0, "usd/judge": 0.5,
                                               "client_cpu_s": 3.0, "env_s": 1.0}}}
    gpu = gpu_split(10.0, 3.0, 0.5)
    log = tmp_path / "gpu.steps.jsonl"
    log.write_text(json.dumps({**base, **gpu, **stale}) + "\n" + json.dumps({**base, **gpu}) + "\n")
    costs = read_costs(log)
    assert costs is not None
    per = costs.per_step()
    assert (per["waste_trajectories_per_step"], per["waste_usd_per_step"],
            per["waste_client_cpu_s_per_step"]) == (1.0, 0.25, 1.5)  # 2 rows
    assert (per["train_gpu_s_per_step"], per["generate_gpu_s_per_step"],
            per["publish_gpu_s_per_step"]) == (3.0, 6.5, 0.5)

    cpu = tmp_path / "cpu.steps.jsonl"  # a trainer on a CPU, nothing refused: no GPU figures
    cpu.write_text(json.dumps(base) + "\n")
    costs = read_costs(cpu)
    assert costs is not None
    per = costs.per_step()
    assert per["waste_trajectories_per_step"] == 0.0 and per["waste_usd_per_step"] == 0.0
    assert not any("gpu" in k for k in per)


def test_a_nodes_waste_tally_is_kept_across_its_restarts(tmp_path: Path) -> None:
    """`NodeWaste`: the tally a node's status reports is kept in its spool at each change
    and read back by the next node of the same name; a team rollout's wall seconds are split
    over its roles."""
    from jetctl.client.spool import Spool
    from jetctl.costs import NodeWaste, client_waste
    from jetctl.rundir import RunPaths

    path = RunPaths(tmp_path).spool("digits-0")
    first = NodeWaste(Spool(path), roles=2)  # a team task of two roles
    assert first.totals == {}, "a new spool: a node's first start"
    # a role's trajectory of a failed rollout (its share of the costs), and one lost whole
    assert first.add([({"usd/judge": 0.25, "client_cpu_s": 0.5}, 4.0), ({}, None)]) == 2
    assert first.add([]) == 0

    second = NodeWaste(Spool(path), roles=2)  # the node restarted under its name
    assert second.totals == {"trajectories": 2.0, "usd/judge": 0.25, "client_cpu_s": 0.5,
                             "rollout_s": 2.0}
    second.add([({"usd/judge": 0.25}, 2.0)])
    assert NodeWaste(Spool(path)).totals == {"trajectories": 3.0, "usd/judge": 0.5,
                                             "client_cpu_s": 0.5, "rollout_s": 3.0}
    # what the run's summary sums from the node's last status
    status = {"task": "digits", "waste": dict(second.totals)}
    assert client_waste([status])["digits"]["usd/judge"] == 0.5
    # in memory only (a node's producer on its own, in tests): counted, kept nowhere
    alone = NodeWaste(roles=1)
    assert alone.add([({"usd/judge": 1.0}, 3.0)]) == 1
    assert alone.totals == {"trajectories": 1.0, "usd/judge": 1.0, "rollout_s": 3.0}


def test_the_spool_adds_a_refused_groups_waste_in_the_acks_own_transaction(
    tmp_path: Path,
) -> None:
    """A refused ack and its waste are one transaction: a node killed after the ack cannot
    have recorded the refusal without the waste (nor the waste of an ack it never recorded:
    a second ack of the same group adds nothing)."""
    from jetctl.client.spool import Spool

    path = tmp_path / "t-0.sqlite"
    spool = Spool(path)
    spool.put("g1", b"x" * 10, 2, trajectory_ids=["a", "b"])
    spool.put("g2", b"y" * 10, 2, trajectory_ids=["c", "d"])
    assert spool.ack("g1", "stale", "too old", waste={"trajectories": 2.0, "usd/judge": 0.5})
    assert not spool.ack("g1", "stale", "too old", waste={"trajectories": 2.0})  # answered twice
    assert spool.dead_letter("g2", ["c", "d"], "too big", waste={"trajectories": 2.0})
    spool.close()
    again = Spool(path)  # what a restarted node reads
    assert again.waste() == {"trajectories": 4.0, "usd/judge": 0.5}
    assert again.counts().outcomes["stale"] == 1 and again.counts().dropped == {"dead-letter": 2}
    # rollouts a killed predecessor left in progress: dropped(lost) and their waste together
    again.start("g3", ["e", "f", "g"])
    again.close()
    third = Spool(path)
    assert third.recover_lost("killed", waste=lambda n: {"trajectories": float(n)}) == 3
    assert third.waste()["trajectories"] == 7.0
    assert third.recover_lost("killed", waste=lambda n: {"trajectories": float(n)}) == 0
    assert third.waste()["trajectories"] == 7.0
