"""The bench's baseline loop (`jetctl.bench.sync_loop`) on builtin:tiny: what it generates
with follows the recipe as the swarm's engine does."""

from __future__ import annotations

import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch

from jetctl.bench.sync_loop import LoopSpec, SyncLoop
from jetctl.recipe import GenerationConfig, load_recipe

pytestmark = [pytest.mark.unit, pytest.mark.timeout(120)]

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(autouse=True)
def _torch_threads() -> Iterator[None]:
    """The loop owns its process (`python -m jetctl.bench.sync_loop`) and sets the process's
    torch threads; in the test process that setting would leak into later tests."""
    threads = torch.get_num_threads()
    yield
    torch.set_num_threads(threads)


def test_the_loop_generates_from_a_copy_in_generation_dtype_refreshed_after_each_step() -> None:
    rec = load_recipe(ROOT / "recipes" / "tiny.yaml")
    model = rec.models["policy"].model_copy(
        update={"generation": GenerationConfig(dtype="bfloat16")})
    spec = LoopSpec(
        model=model.model_dump(mode="json"), task=rec.tasks["digits"].model_dump(mode="json"),
        seconds=60, seed=0, threads=1,
    )
    loop = SyncLoop(spec)
    assert loop.gen_model is not loop.model
    assert {p.dtype for p in loop.gen_model.parameters()} == {torch.bfloat16}
    assert {p.dtype for p in loop.model.parameters()} == {torch.float32}

    groups = loop.rollouts(2)
    assert loop.out["gen_batches"] and all(r.calls for g in groups for r in g)
    for g in groups:  # rewards that differ, so the step moves the weights
        for i, r in enumerate(g):
            r.reward = float(i % 2)
    served = dict(loop.gen_model.named_parameters())
    trained = [(n, p) for n, p in loop.model.named_parameters() if p.requires_grad]
    before = {n: served[n].detach().clone() for n, _ in trained}
    loop.step(groups)
    assert any(not torch.equal(before[n], served[n]) for n, _ in trained)  # refreshed
    for n, p in trained:  # to the trained weights, cast
        assert torch.equal(served[n], p.detach().to(torch.bfloat16)), n


def test_without_generation_dtype_the_loop_generates_on_the_trained_model() -> None:
    rec = load_recipe(ROOT / "recipes" / "tiny.yaml")
    spec = LoopSpec(
        model=rec.models["policy"].model_dump(mode="json"),
        task=rec.tasks["digits"].model_dump(mode="json"), seconds=60, seed=0, threads=1,
    )
    loop = SyncLoop(spec)
    assert loop.gen_model is loop.model and loop.replica is None


def test_with_generation_dtype_auto_the_loop_takes_the_engines_pick_on_this_host() -> None:
    rec = load_recipe(ROOT / "recipes" / "tiny.yaml")
    model = rec.models["policy"].model_copy(update={"generation": GenerationConfig(dtype="auto")})
    spec = LoopSpec(
        model=model.model_dump(mode="json"), task=rec.tasks["digits"].model_dump(mode="json"),
        seconds=60, seed=0, threads=1,
    )
    loop = SyncLoop(spec)
    assert loop.gen_dtype.why.startswith("auto: ")  # measured, as the server's engine measures
    picked = {p.dtype for p in loop.gen_model.parameters()}
    if loop.gen_dtype.dtype == "bfloat16":
        assert loop.gen_model is not loop.model and picked == {torch.bfloat16}
    else:
        assert loop.gen_model is loop.model and picked == {torch.float32}


def test_packed_rows_score_every_completion_token_as_one_sequence_at_a_time_does() -> None:
    """The loop's packing (each group's shared prompt once, a 4-D mask, positions continuing
    from the prefix) against a plain forward of each prompt + completion alone: one-turn rows
    that share the whole prompt, and later-turn rows whose prompts extend it differently."""
    from jetctl.bench.sync_loop import _Row, pack, packed_logprobs
    from jetctl.models import load_model

    model, _ = load_model("builtin:tiny", attn_implementation="sdpa")
    gen = torch.Generator().manual_seed(0)
    V = model.config.vocab_size

    def ids(n: int) -> list[int]:
        return torch.randint(5, V, (n,), generator=gen).tolist()

    p1, p2 = ids(30), ids(20)
    first_turns = [_Row.one_call(p1, ids(n), [0.0] * n, 1.0) for n in (3, 7, 5)]
    later_turns = [_Row.one_call(p2 + ids(k), ids(4), [0.0] * 4, -1.0) for k in (0, 6, 2)]
    batch = pack([first_turns, later_turns])
    with torch.no_grad():
        packed = packed_logprobs(model, batch)
        alone = []
        for row in first_turns + later_turns:
            logp = model(input_ids=torch.tensor([row.tokens])).logits[0]
            logp = logp.float().log_softmax(-1)
            alone += [logp[i - 1, row.tokens[i]] for i in row.scored]
    assert packed.shape == (27,) and batch.input_ids.shape[1] == 30 + 15 + 20 + 8 + 12
    # float32 rounding of a different summation order (1e-7 seen on this model)
    torch.testing.assert_close(packed, torch.stack(alone), rtol=0, atol=1e-5)
    assert batch.advantages.tolist() == [1.0] * 15 + [-1.0] * 12


@pytest.mark.parametrize("dynamic_sampling", [False, True])
def test_the_loop_steps_on_every_round_with_signal_or_on_enough_informative_groups(
    dynamic_sampling: bool,
) -> None:
    """Every group trained as it comes (a round whose groups all scored the same takes no
    step), or, with dynamic sampling, a step per groups_per_step informative groups."""
    rec = load_recipe(ROOT / "recipes" / "tiny.yaml")
    model = rec.models["policy"]
    spec = LoopSpec(
        model=model.model_dump(mode="json"), task=rec.tasks["digits"].model_dump(mode="json"),
        seconds=8, seed=0, threads=1, dynamic_sampling=dynamic_sampling,
    )
    loop = SyncLoop(spec, started=time.monotonic())
    before = [p.detach().clone() for p in loop.params]
    out = loop.run()
    per_step = model.train.groups_per_step
    informative = [g["informative"] for g in out["groups"]]
    rounds = [informative[i : i + per_step] for i in range(0, len(informative), per_step)]
    assert len(rounds) >= 3
    if dynamic_sampling:
        assert len(out["steps"]) == sum(informative) // per_step
    else:
        assert len(out["steps"]) == sum(1 for r in rounds if any(r))
    assert out["steps"] and any(not torch.equal(b, p) for b, p in zip(before, loop.params))


@pytest.mark.parametrize("algorithm,tis_cap", [
    ("grpo", None), ("dr_grpo", None), ("dapo", None), ("gspo", None), ("rloo", None),
    ("grpo", 2.0),
])
def test_the_loop_trains_with_the_recipes_algorithm(algorithm: str, tis_cap: float | None) -> None:
    """`jetctl bench loop --algorithms` runs both sides with train.algorithm: the loop takes
    the registry's advantages and loss (and tis_cap as the server's step does)."""
    from jetctl.server import algorithms

    rec = load_recipe(ROOT / "recipes" / "tiny.yaml")
    model = rec.models["policy"]
    train = model.train.model_copy(update={"algorithm": algorithm, "tis_cap": tis_cap})
    spec = LoopSpec(
        model=model.model_copy(update={"train": train}).model_dump(mode="json"),
        task=rec.tasks["digits"].model_dump(mode="json"), seconds=60, seed=0, threads=1,
    )
    loop = SyncLoop(spec, started=time.monotonic())
    assert type(loop.algorithm) is type(algorithms.make(train))
    groups = loop.rollouts(2)
    for g in groups:  # rewards that differ, so every algorithm has a signal
        for i, r in enumerate(g):
            r.reward = float(i % 3)
    before = [p.detach().clone() for p in loop.params]
    assert loop.step(groups)
    assert any(not torch.equal(b, p) for b, p in zip(before, loop.params))


def test_the_loop_stops_once_its_rolling_reward_reaches_until() -> None:
    """`jetctl bench loop --until R`: the loop ends at the round whose last `window` groups
    average R or more, not at `seconds`."""
    rec = load_recipe(ROOT / "recipes" / "tiny.yaml")
    spec = LoopSpec(
        model=rec.models["policy"].model_dump(mode="json"),
        task=rec.tasks["digits"].model_dump(mode="json"),
        seconds=90, seed=0, threads=1, until=0.5, window=2,
    )
    loop = SyncLoop(spec, started=time.monotonic())
    real, rounds = loop.rollouts, []

    def rollouts(n: int):  # the real rollouts; from the second round on, every answer scores 1
        groups = real(n)
        rounds.append(len(groups))
        for g in groups:
            for r in g:
                r.reward = 1.0 if len(rounds) >= 2 else 0.0
        return groups

    loop.rollouts = rollouts  # type: ignore[method-assign]
    out = loop.run()
    assert len(rounds) == 2 and len(out["groups"]) == 2 * spec.round_groups
    assert out["wall_s"] < spec.seconds


def _turns(question: list[int], turns: int, answer: Any, feedback: Any) -> list[Any]:
    """A fake multi-turn rollout's calls: each prompt is the last prompt, its answer (scored
    at logprob -0.5 a token) and the feedback."""
    from jetctl.bench.sync_loop import _Call

    calls, prompt = [], list(question)
    for _ in range(turns):
        c = _Call(list(prompt), 24, 1.0, 1.0)
        c.completion_ids = answer()
        c.logprobs = [-0.5] * len(c.completion_ids)
        calls.append(c)
        prompt = prompt + c.completion_ids + feedback()
    return calls


def test_a_multi_turn_rollout_trains_as_one_row_scored_as_its_calls_alone() -> None:
    """Ten-turn rollouts: each later call's prompt extends the earlier ids, so a rollout's
    calls join into one row (not one row per call, each with the whole conversation): the
    packed batch is as long as the rollouts' tokens, and each generated token's logprob is
    the one a plain forward of that call's prompt + completion gives."""
    from jetctl.bench.sync_loop import _Call, pack, packed_logprobs, timeline_rows
    from jetctl.models import load_model

    model, _ = load_model("builtin:tiny", attn_implementation="sdpa")
    gen = torch.Generator().manual_seed(1)
    V = model.config.vocab_size

    def ids(n: int) -> list[int]:
        return torch.randint(5, V, (n,), generator=gen).tolist()

    def rollout(question: list[int], turns: int) -> list[_Call]:
        return _turns(question, turns, lambda: ids(5), lambda: ids(7))

    q = ids(40)
    rollouts = [rollout(q, turns) for turns in (10, 3, 1, 10)]
    rows = [r for i, calls in enumerate(rollouts) for r in timeline_rows(calls, 1.0 - i, i)]
    assert len(rows) == 4  # one row per rollout
    last_calls = [calls[-1] for calls in rollouts]
    assert [len(r.tokens) for r in rows] == [len(c.prompt_ids) + 5 for c in last_calls]
    batch = pack([rows])
    assert batch.input_ids.shape[1] == 40 + sum(len(r.tokens) - 40 for r in rows)
    with torch.no_grad():
        packed = packed_logprobs(model, batch)
        alone = []
        for calls in rollouts:
            for c in calls:
                logp = model(input_ids=torch.tensor([c.prompt_ids + c.completion_ids])).logits[0]
                logp = logp.float().log_softmax(-1)
                alone += [logp[len(c.prompt_ids) + k - 1, t] for k, t in enumerate(c.completion_ids)]
    assert packed.shape == (5 * 24,)
    torch.testing.assert_close(packed, torch.stack(alone), rtol=0, atol=1e-5)
    assert batch.seq_index.tolist() == [i for i, n in enumerate((10, 3, 1, 10)) for _ in range(5 * n)]


def test_an_edited_history_starts_a_row_of_its_own() -> None:
    """A call whose prompt does not extend the rollout's row so far (the agent rewrote the
    conversation) is trained as its own row, scored with its own prompt."""
    from jetctl.bench.sync_loop import _Call, timeline_rows

    a = _Call([1, 2, 3], 4, 1.0, 1.0)
    a.completion_ids, a.logprobs = [7, 8], [-1.0, -1.0]
    b = _Call([1, 2, 3, 7, 8, 9], 4, 1.0, 1.0)  # extends a
    b.completion_ids, b.logprobs = [10], [-2.0]
    c = _Call([1, 2, 4], 4, 1.0, 1.0)  # rewritten
    c.completion_ids, c.logprobs = [11, 12], [-3.0, -3.0]
    rows = timeline_rows([a, b, c], 0.5, 0)
    assert [(r.tokens, r.scored, r.logprobs) for r in rows] == [
        ([1, 2, 3, 7, 8, 9, 10], [3, 4, 6], [-1.0, -1.0, -2.0]),
        ([1, 2, 4, 11, 12], [3, 4], [-3.0, -3.0]),
    ]


def test_padded_rows_score_as_the_tree_row_does_and_long_rollouts_pick_them() -> None:
    """The padded layout (a right-padded row per rollout) gives the logprobs the tree row
    gives; the loop picks the tree for one-turn groups (a shared prompt, short answers) and
    padded rows for ten-turn rollouts, whose dense 4-D mask would cost more."""
    from jetctl.bench.sync_loop import (
        _Call,
        _Row,
        pack,
        pack_padded,
        packed_logprobs,
        timeline_rows,
    )

    rec = load_recipe(ROOT / "recipes" / "tiny.yaml")
    spec = LoopSpec(
        model=rec.models["policy"].model_dump(mode="json"),
        task=rec.tasks["digits"].model_dump(mode="json"), seconds=60, seed=0, threads=1,
    )
    loop = SyncLoop(spec)
    gen = torch.Generator().manual_seed(2)
    V = loop.model.config.vocab_size

    def ids(n: int) -> list[int]:
        return torch.randint(5, V, (n,), generator=gen).tolist()

    def rollout(question: list[int], turns: int) -> list[_Call]:
        return _turns(question, turns, lambda: ids(24), lambda: ids(30))

    q = ids(110)
    long_rows = [r for i in range(8) for r in timeline_rows(rollout(q, 10), 1.0, i)]
    short_rows = [_Row.one_call(q, ids(24), [-0.5] * 24, 1.0, i) for i in range(8)]
    assert loop.layout([short_rows, short_rows]) == "tree"
    assert loop.layout([long_rows]) == "padded"
    rows = [r for i in range(3) for r in timeline_rows(rollout(q, 1 + 2 * i), 1.0, i)]
    with torch.no_grad():
        tree = packed_logprobs(loop.model, pack([rows]))
        padded_batch = pack_padded([rows])
        padded = packed_logprobs(loop.model, padded_batch)
    assert padded_batch.input_ids.shape == (3, max(len(r.tokens) for r in rows))
    torch.testing.assert_close(padded, tree, rtol=0, atol=1e-5)
