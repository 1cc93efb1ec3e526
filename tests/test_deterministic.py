"""`run.deterministic: true` (jetctl.deterministic): the seeds, the engines that honour them,
the recipe that refuses the others, and two real runs that generate the same tokens.

The runs are a real `jetctl server --recipe --no-train` (builtin:tiny, engine hf) and a real
`jetctl client --recipe --max-groups` on loopback, twice, each into its own run dir. The
server does not train, so both runs generate from the same seeded initial weights, and what
is left to differ is the sampling: with the flag on, each (group, trajectory) of one run
must hold exactly the token ids of the same (group, trajectory) of the other.
"""

from __future__ import annotations

import asyncio
import os
import sqlite3
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import pytest

from jetctl.auth import write_token
from jetctl.deterministic import SEEDED_ENGINES, RolloutSeeds, request_seed
from jetctl.proto._gen import swarm_pb2 as pb
from jetctl.recipe import ModelConfig, RecipeError, parse_recipe
from jetctl.server.engines import GenRequest, make_engine
from jetctl.server.locks import WeightsLock
from tests.runs import detached_run, jetctl

ROOT = Path(__file__).resolve().parents[1]

RECIPE = """
run: {{name: det, deterministic: true}}
models:
  policy:
    model: builtin:tiny
    engine: {engine}
    runtime: {runtime}
    finetune: full
tasks:
  digits:
    env: envs.digits:make_env
    agent: agents.digits:agent
    model: policy
    group_size: 3
    concurrency: 6
    sampling: {{max_tokens: 6}}
"""


def recipe_text(engine: str = "hf", runtime: str = "process") -> str:
    return RECIPE.format(engine=engine, runtime=runtime)


# ------------------------------------------------------------------ seeds and the recipe


@pytest.mark.unit
def test_a_calls_seed_follows_from_where_it_sits_and_fits_the_wire() -> None:
    seeds = RolloutSeeds("det", "digits-0", group=3, trajectory=1)
    assert seeds.for_call(0) == request_seed("det", "digits-0", 3, 1, 0)  # the same, always
    places = [("det", "digits-0", 3, 1, 0), ("det", "digits-0", 3, 1, 1),
              ("det", "digits-0", 3, 2, 0), ("det", "digits-0", 4, 1, 0),
              ("det", "digits-1", 3, 1, 0), ("other", "digits-0", 3, 1, 0)]
    drawn = [request_seed(*p) for p in places]
    assert len(set(drawn)) == len(places)  # each part of the place changes the seed
    assert all(0 <= s < 2**63 for s in drawn)  # swarm.proto's int64


@pytest.mark.unit
def test_the_flag_is_off_unless_set_and_hf_takes_it() -> None:
    assert not parse_recipe(recipe_text().replace(", deterministic: true", "")).run.deterministic
    assert parse_recipe(recipe_text()).run.deterministic


@pytest.mark.unit
@pytest.mark.parametrize("runtime", ["process", "external"])
def test_an_engine_whose_seeded_replies_do_not_repeat_is_refused(runtime: str) -> None:
    # runtime: process also reports the missing vllm package; the seed's problem comes too
    with pytest.raises(RecipeError) as caught:
        parse_recipe(recipe_text(engine="vllm", runtime=runtime))
    message = str(caught.value)
    assert "models.policy.engine = 'vllm'" in message
    assert "run.deterministic: true" in message
    assert "use engine: hf or continuous, or set run.deterministic: false" in message


# ------------------------------------------------------------------ the hf engine


@pytest.mark.unit
@pytest.mark.timeout(180)  # continuous: its manager starts and stops in 30-60 s here
@pytest.mark.parametrize("engine_name", SEEDED_ENGINES)
def test_each_seeded_engine_gives_a_seeded_request_the_same_sample_twice(
    engine_name: str,
) -> None:
    """hf draws a seeded request from a generator of its own; continuous hands it to its hf
    fallback. The shared stream and the company in the batch change between the two."""
    import torch

    from jetctl.models import load_model

    model, tokenizer = load_model("builtin:tiny", progress=False)
    eos = int(tokenizer.eos_token_id)
    cfg = ModelConfig(model="builtin:tiny", finetune="full", engine=engine_name)
    engine = make_engine(cfg, model, eos_token_ids=[eos], pad_token_id=eos,
                         weights_lock=WeightsLock(), version=lambda: 0).engine
    seed = RolloutSeeds("det", "digits-0", 0, 0).for_call(0)  # a run's seed: up to 2**63

    def request(seed: int) -> GenRequest:
        return GenRequest([5, 6, 7, 8], max_tokens=12, temperature=1.0, top_p=1.0,
                          stop_token_ids=(), seed=seed)

    async def main() -> list[list[int]]:
        engine.start()
        try:
            torch.manual_seed(1)  # the shared stream differs between the two: no matter
            first = await engine.generate(request(seed))
            torch.manual_seed(2)
            again, other = await asyncio.gather(engine.generate(request(seed)),
                                                engine.generate(request(seed + 1)))
        finally:
            await engine.stop()
        return [first.completion_ids, again.completion_ids, other.completion_ids]

    first, again, other = asyncio.run(main())
    assert len(first) == 12 and first == again
    assert other != first  # another seed, another sample (12 tokens of a 1k vocabulary)


# ------------------------------------------------------------------ two real runs


def _run(run_dir: Path, groups: int) -> dict[str, list[int]]:
    """One short run: {"group/trajectory": the completion ids of its call}."""
    run_dir.mkdir()
    write_token(run_dir / "token", "t")
    recipe = run_dir / "r.yaml"
    recipe.write_text(recipe_text())
    env = {**os.environ, "JETCTL_TOKEN": "t"}
    cli = [sys.executable, "-m", "jetctl.cli.main"]
    log = run_dir / "server.log"
    server = subprocess.Popen(
        [*cli, "server", "--recipe", str(recipe), "--model", "policy", "--run-dir",
         str(run_dir), "--no-train"], cwd=ROOT, env=env, stdout=log.open("w"),
        stderr=subprocess.STDOUT,
    )
    try:
        deadline = time.monotonic() + 120
        while not (run_dir / "servers" / "policy.json").exists():
            assert server.poll() is None and time.monotonic() < deadline, log.read_text()
            time.sleep(0.2)
        client = subprocess.run(
            [*cli, "client", "--recipe", str(recipe), "--task", "digits", "--index", "0",
             "--run-dir", str(run_dir), "--max-groups", str(groups)],
            cwd=ROOT, env=env, capture_output=True, text=True, timeout=200, check=False,
        )
        assert client.returncode == 0, client.stdout[-3000:] + client.stderr[-3000:]
        db = sqlite3.connect(run_dir / "server-policy" / "store.sqlite")
        payloads = [p for (p,) in db.execute("SELECT payload FROM groups")]
        db.close()
    finally:
        server.terminate()
        assert server.wait(60) == 0, log.read_text()[-3000:]
    tokens: dict[str, list[int]] = {}
    for payload in payloads:
        for t in pb.TrajectoryGroup.FromString(payload).trajectories:
            (call,) = t.calls  # the digits agent makes one call
            tokens[t.metadata["seeded_at"]] = list(call.completion_ids)
    return tokens


@pytest.mark.integration
@pytest.mark.timeout(300)
def test_two_deterministic_runs_generate_the_same_tokens(tmp_path: Path) -> None:
    groups = 4
    first, second = _run(tmp_path / "a", groups), _run(tmp_path / "b", groups)
    every = {f"{g}/{t}" for g in range(groups) for t in range(3)}
    assert set(first) == every and set(second) == every  # no rollout failed or went missing
    assert first == second
    # and the seeds are not all one: the rollouts of a group sample differently
    assert any(len({tuple(first[f"{g}/{t}"]) for t in range(3)}) > 1 for g in range(groups))


# ------------------------------------------------------------------ the trainer


@pytest.mark.unit
@pytest.mark.timeout(120)
def test_the_trainer_steps_under_torchs_deterministic_algorithms_and_repeats(
    tmp_path: Path,
) -> None:
    """What `jetctl server` turns on with the flag: no op of a training step on the CPU is
    refused by torch's deterministic mode, and two trainers from the same start reach the
    same weights bit for bit."""
    import torch

    from jetctl.deterministic import use_deterministic_torch
    from tests.server.trainer_support import config, make_trainer, same_weights, step, submit
    from tests.server.trainer_support import weights as weights_of

    use_deterministic_torch()
    try:
        trained = []
        for name in ("a", "b"):
            (tmp_path / name).mkdir()
            torch.manual_seed(0)
            trainer = make_trainer(tmp_path / name, config(finetune="lora"))
            start = weights_of(trainer.model)
            for i in range(3):
                submit(trainer, rewards=(0.0, 1.0 + i, 0.5))
                assert step(trainer) is not None
            trained.append(weights_of(trainer.model))
            assert not same_weights(start, trained[-1])  # the steps moved the adapter
        assert same_weights(trained[0], trained[1])
    finally:
        torch.use_deterministic_algorithms(False)


# ------------------------------------------------------------------ the task stream


class _UnusedLink:
    """A controller link that must not be asked: any call is a test failure."""

    def __getattr__(self, name: str) -> Any:
        raise AssertionError(f"the deterministic task stream asked the controller ({name})")


@pytest.mark.unit
def test_a_dataset_on_a_node_with_a_controller_comes_in_the_nodes_seeded_order(
    tmp_path: Path,
) -> None:
    """With the flag (`leased=False`) a dataset env's rows come from its own `tasks(rng)`,
    seeded by `task.seed + index`, even where a controller would lease them."""
    import random

    from jetctl.client.rows import task_source
    from jetctl.envs.dataset import DatasetEnv

    data = tmp_path / "rows.jsonl"
    data.write_text("".join(f'{{"prompt": "row {i}"}}\n' for i in range(8)))

    async def prompts(seed: int) -> list[str]:
        source = task_source(
            DatasetEnv(path=str(data), epochs=1), _UnusedLink(),  # type: ignore[arg-type]
            node="rows-0", task="rows", rng=random.Random(seed), block=2,
            stop=asyncio.Event(), leased=False,
        )
        seen = []
        while (picked := await source.next()) is not None:
            seen.append(picked.task.prompt)
        await source.close()
        return seen

    first, again, other = (asyncio.run(prompts(s)) for s in (0, 0, 1))
    assert sorted(first) == sorted(f"row {i}" for i in range(8))  # every row, once
    assert first == again and other != first
    order = list(range(8))
    random.Random(0).shuffle(order)
    assert first == [f"row {i}" for i in order]


def _stored_groups(run_dir: Path) -> int:
    """The groups the run's server has stored so far (0 before its store is there)."""
    path = run_dir / "server-policy" / "store.sqlite"
    if not path.exists():
        return 0
    try:
        db = sqlite3.connect(path, timeout=5)
        try:
            return int(db.execute("SELECT COUNT(*) FROM groups").fetchone()[0])
        finally:
            db.close()
    except sqlite3.Error:
        return 0


def _up(run_dir: Path) -> dict[str, tuple[int, list[int]]]:
    """One short `jetctl up` (it trains): {"node:group/trajectory": (version, completion ids)}.
    Downed once its server stored 4 groups: the down drains the rollouts in flight, so the
    first groups (0 and 1, whose calls all went out at version 0) are stored in either run."""
    run_dir.mkdir()
    recipe = run_dir / "r.yaml"
    recipe.write_text(recipe_text().replace("run: {name: det, deterministic: true}",
                                            "run: {name: det, deterministic: true, duration_s: 240}"))
    with detached_run(recipe, run_dir):
        deadline = time.monotonic() + 240
        while _stored_groups(run_dir) < 4:
            assert time.monotonic() < deadline, "fewer than 4 groups stored in 240 s"
            time.sleep(0.5)
        down = jetctl("down", "--run-dir", str(run_dir), check=False)
        assert down.returncode == 0, down.stdout[-3000:] + down.stderr[-3000:]
    db = sqlite3.connect(run_dir / "server-policy" / "store.sqlite")
    payloads = [p for (p,) in db.execute("SELECT payload FROM groups")]
    db.close()
    out: dict[str, tuple[int, list[int]]] = {}
    for payload in payloads:
        for t in pb.TrajectoryGroup.FromString(payload).trajectories:
            (call,) = t.calls
            out[f"{t.client_id}:{t.metadata['seeded_at']}"] = (call.model_version,
                                                                list(call.completion_ids))
    return out


@pytest.mark.integration
@pytest.mark.timeout(600)
def test_under_jetctl_up_the_controller_seeds_its_nodes_calls(tmp_path: Path) -> None:
    """The controller tells the nodes it starts (Join): two `jetctl up` runs, which train, give
    the same tokens for every rollout both generated from the same weights (version 0)."""
    with ThreadPoolExecutor(2) as pool:  # the two runs side by side (free ports each)
        first, second = pool.map(lambda d: _up(tmp_path / d), ("a", "b"))
    both = sorted(k for k in set(first) & set(second) if first[k][0] == second[k][0] == 0)
    assert len(both) >= 6, (len(first), len(second))  # at least two groups of 3 at version 0
    assert all(first[k][1] == second[k][1] for k in both)
    assert len({tuple(first[k][1]) for k in both}) > 1  # not one sample for all
