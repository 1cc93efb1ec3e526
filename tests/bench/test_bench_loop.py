"""`jetctl bench loop`'s figures from fakes of what it measures (no model, no processes)."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import pytest
import yaml

from jetctl.bench.loop import CpuSampler, figures

ROOT = Path(__file__).resolve().parents[2]

pytestmark = pytest.mark.unit


def test_trainer_busy_counts_only_training_after_the_first_step() -> None:
    """A loop of few long steps (two-turn runs: 68 s of training per step, ending at 116 s
    and 197 s of a 221 s run): the first step trained before the window [116, 221] opens,
    so the trainer was busy 68 of its 105 s, not (68 + 68) / 105 = 130%."""
    groups = [{"t": t, "reward": 0.5, "n": 8, "informative": True} for t in (40.0, 130.0)]
    fig = figures("loop", 0.0, 0, wall_s=221.0, groups=groups, step_times=[116.0, 197.0],
                  train=[(116.0, 68.0), (197.0, 68.0)], gen_batches=[16.0],
                  staleness=[0.0, 0.0], cpu_s={})
    assert fig.trainer_busy == pytest.approx(68.0 / 105.0)


def test_trainer_busy_of_a_step_across_the_window_start_counts_its_part_inside() -> None:
    """The swarm's second step began training before the first one ended (a step row's time
    is its end): 3 of its 10 s fall after the first step, plus all of the third step's 5."""
    fig = figures("swarm", 0.0, 0, wall_s=50.0, groups=[], step_times=[20.0, 23.0, 40.0],
                  train=[(20.0, 12.0), (23.0, 10.0), (40.0, 5.0)], gen_batches=[],
                  staleness=[], cpu_s={})
    assert fig.trainer_busy == pytest.approx((3.0 + 5.0) / 30.0)


@dataclass
class FakeCpuTimes:
    user: float
    system: float = 0.0
    children_user: float = 0.0
    children_system: float = 0.0


@dataclass
class FakeProcess:
    """What CpuSampler reads of a psutil.Process."""

    pid: int
    argv: list[str]
    user: float = 0.0
    reaped: float = 0.0

    def cmdline(self) -> list[str]:
        return self.argv

    def cpu_times(self) -> FakeCpuTimes:
        return FakeCpuTimes(self.user, children_user=self.reaped)


PY = ["/usr/bin/python3", "-m", "jetctl.cli.main"]


def test_an_exiting_server_keeps_its_cpu_under_server() -> None:
    """As the run ends the server exits: its /proc cmdline reads empty while its CPU times
    are still there. The last sample must file them under "server", not "other"."""
    controller = FakeProcess(1, [*PY, "up", "/tmp/run.yaml"], user=9.0)
    server = FakeProcess(2, [*PY, "server", "--model", "policy", "--port", "5"], user=100.0)
    client = FakeProcess(3, [*PY, "client", "--task", "t", "--index", "0"], user=20.0)
    forkserver = FakeProcess(
        4, ["/usr/bin/python3", "-c", "from multiprocessing.forkserver import main"],
        user=1.0, reaped=10.0,
    )
    sampler = CpuSampler(root_pid=1)
    sampler.sample([controller, server, client, forkserver])
    server.argv, server.user = [], 301.0  # exiting: no command line, final CPU seconds
    sampler.sample([controller, server, client, forkserver])
    assert sampler.totals() == {"controller": 9.0, "server": 301.0, "client": 20.0,
                              "rollouts": 11.0}


def test_a_process_read_before_its_exec_takes_its_role_once_it_has_one() -> None:
    """Between fork and exec a child shows its parent's command line (the controller's);
    the next sample, after the exec, files it under what it became."""
    sampler = CpuSampler(root_pid=1)
    child = FakeProcess(7, [*PY, "up", "/tmp/run.yaml"], user=0.0)
    sampler.sample([child])
    child.argv, child.user = [*PY, "server", "--model", "policy"], 50.0
    sampler.sample([child])
    assert sampler.totals() == {"server": 50.0}


def test_the_table_shows_each_seed_and_the_swarm_over_the_loop_seed_by_seed() -> None:
    """Medians with every seed's value beside them, and a row of per-seed ratios of the
    time to each reward (one seed where the swarm never got there reads '>' the bound its run
    gives: its 200 s over the loop's 97)."""
    from rich.console import Console

    from jetctl.bench.loop import render

    def run(mode: str, seed: int, reach8: float | None) -> object:
        # rolling reward: 0.9 from the time given on (20 groups of 0.9 after it), else 0.1
        at = reach8 if reach8 is not None else 1e9
        groups = [{"t": float(t), "reward": 0.9 if t >= at else 0.1, "n": 8,
                   "informative": True} for t in range(1, 200)]
        return figures(mode, 2.0, seed, wall_s=200.0, groups=groups,
                       step_times=[10.0, 20.0, 30.0], train=[], gen_batches=[],
                       staleness=[], cpu_s={})

    results = [run("loop", 0, 100.0), run("swarm", 0, 40.0), run("loop", 1, 80.0),
               run("swarm", 1, None), run("loop", 2, 100.0), run("swarm", 2, 60.0)]
    console = Console(width=250, record=True)
    console.print(render(results))  # type: ignore[arg-type]
    text = console.export_text()
    row = next(line for line in text.splitlines() if "0.8, swarm/loop by seed" in line)
    # 0.8 over 20 groups needs 18 of them at 0.9: 17 s after the switch
    assert "0.49,>2.06,0.66" in row.replace(" ", "")
    row = next(line for line in text.splitlines() if "reward >= 0.8 at (s)" in line)
    assert "117(117,97,117)" in row.replace(" ", "")  # the loop: median and each seed
    assert "67(57,-,77)" in row.replace(" ", "")


def test_a_seed_only_one_side_got_there_reads_as_a_bound_from_the_other_runs_length() -> None:
    """Only the swarm reached the reward (at 166 s) while the loop ran 420 s without: the
    swarm took under 0.40x the loop's time, not '0'; the other way round, over the ratio."""
    from jetctl.bench.loop import _seed_ratio

    assert _seed_ratio([None], [166.0], [420.0], [400.0]) == "<0.40"
    assert _seed_ratio([210.0], [None], [420.0], [420.0]) == ">2.00"
    assert _seed_ratio([None], [None], [420.0], [420.0]) == "-"
    assert _seed_ratio([200.0], [100.0], [420.0], [420.0]) == "0.50"


def test_a_swarm_variant_gets_its_own_columns_beside_the_one_loop() -> None:
    """--swarm-train: each variant's swarm runs are compared with the same loop runs."""
    from rich.console import Console

    from jetctl.bench.loop import parse_variant, render

    def run(mode: str, seed: int, reach8: float, variant: str = "") -> object:
        groups = [{"t": float(t), "reward": 0.9 if t >= reach8 else 0.1, "n": 8,
                   "informative": True} for t in range(1, 200)]
        fig = figures(mode, 5.0, seed, wall_s=200.0, groups=groups,
                      step_times=[10.0, 20.0, 30.0], train=[], gen_batches=[],
                      staleness=[], cpu_s={})
        fig.variant = variant
        return fig

    results = [run("loop", 0, 100.0), run("swarm", 0, 80.0), run("swarm", 0, 40.0, "tis_cap=2"),
               run("loop", 1, 100.0), run("swarm", 1, 120.0), run("swarm", 1, 60.0, "tis_cap=2")]
    console = Console(width=300, record=True)
    console.print(render(results))  # type: ignore[arg-type]
    text = console.export_text()
    assert "swarm 5s tis_cap=2" in text
    row = next(line for line in text.splitlines() if "reward >= 0.8 at (s)" in line)
    cells = row.replace(" ", "").split("│")
    # loop, swarm, ratio for the recipe's runs; loop, swarm, ratio for the variant's
    assert cells[2:8] == ["117(117,117)", "117(97,137)", "1.00x", "117(117,117)",
                          "67(57,77)", "0.57x"]
    assert parse_variant("tis_cap=2.0 order=newest") == {"tis_cap": 2.0, "order": "newest"}
    with pytest.raises(ValueError, match="key=value"):
        parse_variant("tis_cap")


def test_a_variant_sets_the_train_block_or_the_block_it_names() -> None:
    """--swarm-train 'lr...': a bare key is train's; generation.max_batch_size is
    generation's; a wrong key is refused with its path before any run starts."""
    from jetctl.bench.loop import check_variant, parse_variant, task_recipe

    raw = yaml.safe_load((ROOT / "recipes" / "quickstart.yaml").read_text())
    out = task_recipe(raw, "arithmetic", seconds=60, latency_s=0, seed=0, run_dir=Path("r"),
                      train=parse_variant("lend_threads=true generation.max_batch_size=32"))
    m = out["models"]["policy"]
    assert m["train"]["lend_threads"] is True and m["train"]["groups_per_step"] == 2
    assert m["generation"] == {**raw["models"]["policy"]["generation"], "max_batch_size": 32}
    with pytest.raises(ValueError, match="generation.max_batch_sise"):
        check_variant(ROOT / "recipes" / "quickstart.yaml", None, "generation.max_batch_sise=3")


def test_steps_and_groups_to_a_reward_count_what_was_trained_by_then() -> None:
    """Learning per step and per informative group: the steps that ended by the time the
    rolling reward first reached 0.8, and the groups with a signal those steps trained (a
    loop's step may train one group of its round's two)."""
    groups = [{"t": float(t), "reward": 0.9 if t >= 50 else 0.1, "n": 8, "informative": True}
              for t in range(1, 100)]
    fig = figures("loop", 0.0, 0, wall_s=100.0, groups=groups,
                  step_times=[30.0, 10.0, 20.0, 60.0, 90.0], train=[], gen_batches=[],
                  staleness=[], cpu_s={}, step_groups=[2, 1, 1, 2, 2])
    assert fig.reach_s["0.8"] == 67.0  # 18 of the last 20 groups at 0.9
    assert fig.steps_to["0.8"] == 4  # steps at 10, 20, 30 and 60 s
    assert fig.groups_to["0.8"] == 1 + 1 + 2 + 2  # in time order, not the order given
    never = figures("swarm", 0.0, 0, wall_s=100.0, groups=groups[:40], step_times=[10.0],
                    train=[], gen_batches=[], staleness=[], cpu_s={}, step_groups=[2])
    assert never.steps_to["0.8"] is None and never.groups_to["0.8"] is None


def test_until_stops_the_swarm_process_once_the_stores_rolling_reward_reaches_it(
    tmp_path: Path,
) -> None:
    """`--until`: the watcher reads the server's store (accepted groups in arrival order) and
    SIGTERMs the run once the mean of the last WINDOW groups reaches the threshold; a
    rolling reward below it leaves the run alone."""
    import signal
    import sqlite3
    import subprocess
    import threading
    import time

    from jetctl.bench.loop import WINDOW, _stop_when_reached

    store = tmp_path / "store.sqlite"
    db = sqlite3.connect(store)
    db.execute("CREATE TABLE groups (received_at REAL, reward_sum REAL, n_traj INT, state TEXT)")
    now = time.time()
    rows = [(now + i, 2.0, 8, "trained") for i in range(WINDOW)]  # mean reward 0.25
    db.executemany("INSERT INTO groups VALUES (?, ?, ?, ?)", rows)
    db.commit()
    proc = subprocess.Popen(["sleep", "60"])
    watcher = threading.Thread(target=_stop_when_reached, args=(proc, store, now, 0.8),
                               kwargs={"interval_s": 0.1}, daemon=True)
    watcher.start()
    time.sleep(0.5)
    assert proc.poll() is None  # 0.25 < 0.8: still running
    db.executemany("INSERT INTO groups VALUES (?, ?, ?, ?)",  # now the last WINDOW score 7/8
                   [(now + WINDOW + i, 7.0, 8, "buffered") for i in range(WINDOW)])
    db.commit()
    db.close()
    assert proc.wait(timeout=10) == -signal.SIGTERM
    watcher.join(timeout=5)
    assert not watcher.is_alive()


def test_a_swarm_variant_that_makes_a_bad_recipe_is_refused_naming_the_field() -> None:
    from jetctl.bench.loop import check_variant

    recipe = Path(__file__).resolve().parents[2] / "recipes" / "quickstart.yaml"
    check_variant(recipe, None, "tis_cap=2.0 order=newest")  # valid: no error
    with pytest.raises(ValueError, match=r"train\.tis_cap: .*greater than or equal to 1"):
        check_variant(recipe, None, "tis_cap=0.5")
    with pytest.raises(ValueError, match=r"train\.bogus"):
        check_variant(recipe, None, "bogus=1")
