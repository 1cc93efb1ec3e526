"""The trainer on builtin:tiny with a real store: staleness at batch time, zero-variance
groups, the KL penalty, checkpoint cadence and resume (folders and fsspec URLs)."""

from __future__ import annotations

from pathlib import Path

import fsspec
import pytest
import torch

from jetctl.proto.convert import group_to_pb
from jetctl.recipe import CheckpointConfig, ModelConfig, TrainConfig
from jetctl.server import checkpoint as ckpt
from jetctl.server import merge
from jetctl.server.adapter import adapter_mode
from jetctl.server.figures import SIGNAL_WINDOW, TrainerFigures
from jetctl.server.step import load_trainable, token_logprobs
from jetctl.server.trainer import Trainer
from tests.factories import make_group
from tests.server.trainer_support import (
    PROMPT,
    config,
    make_trainer,
    same_weights,
    step,
    submit,
    weights,
)

pytestmark = pytest.mark.unit

def test_a_group_that_went_stale_in_the_buffer_is_refused_at_batch_time(tmp_path: Path) -> None:
    trainer = make_trainer(tmp_path, config(max_staleness=1))
    late = submit(trainer, version=0)  # fresh when accepted ...
    (held,) = trainer.store.take(1, timeout_s=0.1)  # ... but waits while two steps happen
    for _ in range(2):
        submit(trainer)
        assert step(trainer) is not None
    assert trainer.version == 2
    trainer.store.give_back([held])
    before = weights(trainer.model)
    assert step(trainer) is None, "no step on a batch whose only group is stale"
    assert trainer.version == 2 and same_weights(before, weights(trainer.model))
    recorded = trainer.store.recorded(late.id)
    assert recorded is not None and recorded.outcome == "stale"
    assert "at batch time" in recorded.reason
    assert trainer.figures.stale_at_batch == len(late.trajectories)
    assert trainer.store.buffer_depth == 0


@pytest.mark.parametrize("order", ["oldest", "newest"])
def test_train_order_picks_which_buffered_groups_train_first(tmp_path: Path, order: str) -> None:
    """Groups made at versions 0, 3, 5 and 4 wait while the trainer is at version 5
    (max_staleness 4). The version-0 group is refused as stale before any step, in either
    order; then `oldest` trains them in arrival order and `newest` the highest version first.
    Every group ends trained or refused."""
    trainer = make_trainer(tmp_path, config(max_staleness=4, order=order))
    trainer.version = 5  # as if five steps ran
    made = {v: submit(trainer, version=v) for v in (0, 3, 5, 4)}
    trained: list[int] = []  # the version each step's group was made at, step by step
    for _ in range(3):
        before = trainer.version
        assert step(trainer) is not None and trainer.version == before + 1
        trained.append(before - trainer.figures.recent_lags["digits"][-1])
    stale = trainer.store.recorded(made[0].id)
    assert stale is not None and stale.outcome == "stale" and "at batch time" in stale.reason
    assert trained == ([3, 5, 4] if order == "oldest" else [5, 4, 3])
    assert trainer.store.buffer_depth == 0


def test_zero_variance_groups_change_no_weight(tmp_path: Path) -> None:
    """Every rollout of a group scored the same: GRPO's advantages are all zero, so the
    group carries no signal; it must not move the weights or the version, nor stay buffered."""
    trainer = make_trainer(tmp_path, config())
    before = weights(trainer.model)
    flat = [submit(trainer, rewards=(1.0, 1.0)), submit(trainer, rewards=(0.0, 0.0, 0.0))]
    for _ in range(4):
        step(trainer)
    assert trainer.version == 0 and same_weights(before, weights(trainer.model))
    assert trainer.store.buffer_depth == 0
    for g in flat:
        assert trainer.store.recorded(g.id) is not None
    informative = submit(trainer, rewards=(0.0, 1.0))
    while trainer.version == 0:
        assert step(trainer) is not None or trainer.store.buffer_depth
    assert not same_weights(before, weights(trainer.model))
    assert trainer.store.recorded(informative.id) is not None


def test_checkpoints_follow_every_steps_and_keep(tmp_path: Path) -> None:
    trainer = make_trainer(tmp_path, config(checkpoint=CheckpointConfig(every_steps=2, keep=2)))
    for _ in range(5):
        submit(trainer)
        assert step(trainer) is not None
    assert trainer.version == 5
    names = sorted(p.name for p in (tmp_path / "checkpoints").iterdir())
    assert names == ["step-00000002", "step-00000004"]
    trainer.stop()  # stopping checkpoints what is new since the last checkpoint
    names = sorted(p.name for p in (tmp_path / "checkpoints").iterdir())
    assert names == ["step-00000004", "step-00000005"]  # keep: 2


@pytest.mark.parametrize("where", ["folder", "file_url", "memory_url"])
def test_resume_restores_weights_optimizer_and_version(tmp_path: Path, where: str) -> None:
    target = {"folder": str(tmp_path / "ck"), "file_url": f"file://{tmp_path}/ck",
              "memory_url": f"memory://jetctl-test-{tmp_path.name}/ck"}[where]
    cfg = config(checkpoint=CheckpointConfig(every_steps=3, keep=2))
    first = make_trainer(tmp_path / "a", cfg, checkpoint_dir=target)
    for _ in range(3):
        submit(first)
        step(first)
    assert first.version == 3
    trained = weights(first.model)
    moments = first.optimizer.state_dict()["state"]
    assert ckpt.latest(target) is not None
    # written where the URL points, not into a local folder named after its scheme
    if where == "memory_url":
        assert fsspec.filesystem("memory").isdir(f"/jetctl-test-{tmp_path.name}/ck/step-00000003")
    else:
        assert (tmp_path / "ck" / "step-00000003" / "manifest.json").is_file()

    second = make_trainer(tmp_path / "b", cfg, checkpoint_dir=target)
    assert second.version == 3
    assert same_weights(trained, weights(second.model))
    again = second.optimizer.state_dict()["state"]
    assert torch.equal(moments[0]["exp_avg"], again[0]["exp_avg"])
    submit(second)
    assert step(second) is not None and second.version == 4, "training goes on from there"


def test_a_torn_checkpoint_is_never_loaded(tmp_path: Path) -> None:
    cfg = config(checkpoint=CheckpointConfig(every_steps=1, keep=5))
    first = make_trainer(tmp_path / "a", cfg, checkpoint_dir=str(tmp_path / "ck"))
    for _ in range(2):
        submit(first)
        step(first)
    newest = tmp_path / "ck" / "step-00000002" / "weights.safetensors"
    newest.write_bytes(newest.read_bytes()[:-7] + b"garbage")  # the manifest's sha256 fails
    second = make_trainer(tmp_path / "b", cfg, checkpoint_dir=str(tmp_path / "ck"))
    assert second.version == 1


# --------------------------------------------------------------------------- KL penalty


def reference_kl(trainer: Trainer) -> float:
    """Mean k3 KL(policy || base model) over a fixed completion."""
    g = make_group(prompt=PROMPT, completion=(21, 22, 23, 24, 25))
    (mb,) = merge.pack(merge.timeline_sequences(g.trajectories[0], 1.0, "off"), "off", 8192)
    with torch.no_grad():
        new = token_logprobs(trainer.model, mb)
        with adapter_mode("reference"):
            ref = token_logprobs(trainer.model, mb)
    return float((torch.exp(ref - new) - (ref - new) - 1).mean())


def train_lora(tmp_path: Path, kl_coef: float, steps: int) -> tuple[Trainer, list[dict[str, float]]]:
    cfg = config(finetune="lora", kl_coef=kl_coef)
    trainer = make_trainer(tmp_path, cfg)
    torch.manual_seed(0)
    scalars = []
    for i in range(steps):
        submit(trainer, rewards=(0.0, 1.0) if i % 2 else (1.0, 0.0))
        s = step(trainer)
        assert s is not None
        scalars.append(s)
    return trainer, scalars


def test_kl_penalty_holds_the_policy_near_the_base_model(tmp_path: Path) -> None:
    free, _ = train_lora(tmp_path / "free", kl_coef=0.0, steps=8)
    held, scalars = train_lora(tmp_path / "held", kl_coef=5.0, steps=8)
    # a fresh adapter adds exactly zero (lora_B starts at 0): the policy is the reference
    assert scalars[0]["kl_ref"] == 0.0
    assert scalars[-1]["kl_ref"] > 0.0, "the penalty sees the policy move"
    assert reference_kl(free) > 0.0
    assert reference_kl(held) < 0.5 * reference_kl(free)


def test_kl_penalty_is_refused_without_a_reference(tmp_path: Path) -> None:
    cfg = ModelConfig.model_construct(  # the recipe refuses it; the trainer checks again
        **{**config().__dict__, "train": TrainConfig(kl_coef=0.1)}
    )
    model, _ = load_trainable(config(), attn_implementation="sdpa")
    with pytest.raises(ValueError, match="kl_coef > 0 needs finetune: lora"):
        make_trainer(tmp_path, cfg, model=model)


def test_every_step_trains_on_groups_per_step_informative_groups(tmp_path: Path) -> None:
    """Dynamic sampling: groups without signal never take a batch slot. They are consumed
    (recorded, out of the buffer), counted in the next step's row, and no row is written
    without a step."""
    trainer = make_trainer(tmp_path, config(groups_per_step=2))
    order = [(1.0, 1.0), (0.0, 1.0), (0.0, 0.0), (0.5, 0.5), (1.0, 0.0)]
    groups = [submit(trainer, rewards=r) for r in order]
    rows = []
    for _ in range(6):
        scalars = step(trainer)
        if scalars is not None:
            rows.append(scalars)
    assert trainer.version == 1 and len(rows) == 1
    row = rows[0]
    assert row["groups"] == 2 and row["groups/skipped"] == 3
    assert row["frac_reward_zero_std"] == pytest.approx(3 / 5)
    # the rollouts' reward: every consumed group, skipped ones included
    everything = [r for rs in order for r in rs]
    assert row["reward/mean"] == pytest.approx(sum(everything) / len(everything))
    assert row["reward/trained_mean"] == pytest.approx(0.5)
    assert trainer.store.buffer_depth == 0
    assert all(trainer.store.recorded(g.id) is not None for g in groups)
    logged = trainer.steps_log.read_text().splitlines()
    assert len(logged) == 1, "a row per optimizer step, none for skipped groups"


def test_a_run_without_signal_is_told_apart_collapsed_or_solved(tmp_path: Path) -> None:
    trainer = make_trainer(tmp_path, config(groups_per_step=1))
    submit(trainer, rewards=(0.0, 1.0))  # the best group mean seen: 0.5
    step(trainer)
    assert trainer.figures.signal()[1] == "ok"
    for _ in range(SIGNAL_WINDOW):  # every answer the same well-formed wrong one
        submit(trainer, rewards=(0.2, 0.2, 0.2))
        step(trainer)
    share, verdict = trainer.figures.signal()
    assert share > 0.9 and verdict == "collapsed"
    for _ in range(SIGNAL_WINDOW):  # every answer right
        submit(trainer, rewards=(1.0, 1.0))
        step(trainer)
    assert trainer.figures.signal() == (1.0, "solved")


def test_the_signal_is_judged_per_task_against_its_own_best_reward(tmp_path: Path) -> None:
    """One task solved beside another still learning is not a collapse (the old verdict
    called the run collapsed unless every flat group scored the best reward of any task), a
    solved task's rare all-wrong group does not turn it into one, and a task that answers
    the same wrong thing every time is named."""
    f = TrainerFigures()
    for i in range(SIGNAL_WINDOW):
        # web: every rollout right, except one group in 16 where every rollout failed
        f.note_consumed("web", informative=False, mean=0.0 if i % 16 == 0 else 1.0)
        # code: still learning; its best group mean so far is 0.75
        f.note_consumed("code", informative=True, mean=0.75 if i == 0 else 0.5)
    by_task = f.signal_by_task()
    assert by_task == {"web": (1.0, "solved"), "code": (0.0, "ok")}
    assert f.signal() == (0.5, "ok"), "one task solved, one learning: the run is fine"
    for _ in range(SIGNAL_WINDOW):  # code: one well-formed wrong answer for every sample
        f.note_consumed("code", informative=False, mean=0.2)
    assert f.signal_by_task()["code"] == (1.0, "collapsed")
    assert f.signal() == (1.0, "collapsed")
    for _ in range(SIGNAL_WINDOW):  # code: every rollout right now, at a new best of 1.0
        f.note_consumed("code", informative=False, mean=1.0)
    assert f.signal_by_task() == {"web": (1.0, "solved"), "code": (1.0, "solved")}
    assert f.signal() == (1.0, "solved")


def test_the_per_task_signal_reaches_status_and_names_the_task(tmp_path: Path) -> None:
    """Two tasks on one server, web solved and code collapsed: Status carries each task's
    verdict through the controller's JSON, and `jetctl status` names the task it warns
    about; with one task the warning names the model alone."""
    import json

    from rich.console import Console

    from jetctl.controller.probe import status_to_dict
    from jetctl.proto._gen import control_pb2 as cpb
    from jetctl.proto._gen import swarm_pb2 as spb
    from jetctl.run.status import document, render_status

    def put(rewards: tuple[float, ...], task: str) -> None:
        g = make_group(rewards=rewards, version=trainer.version, prompt=PROMPT,
                       completion=(21, 22, 23), task=task)
        assert trainer.store.put(g, group_to_pb(g).SerializeToString()).result(5).outcome \
            == "accepted"

    def shown(figures: TrainerFigures) -> str:
        share, verdict = figures.signal()
        by_task = figures.signal_by_task()
        reply = spb.StatusReply(  # as SwarmService.status fills them
            model="policy", signal=verdict, no_signal_recent=share,
            no_signal_by_task={t: v[0] for t, v in by_task.items()},
            signal_by_task={t: v[1] for t, v in by_task.items()},
        )
        doc = document(cpb.RunStatusReply(run="t", run_dir="/runs/t", state="running", nodes=[
            cpb.NodeStatus(name="server-policy", kind="server", model="policy",
                           state="running", json=json.dumps(status_to_dict(reply)))]))
        console = Console(width=400, record=True)
        console.print(render_status(doc))
        return console.export_text()

    trainer = make_trainer(tmp_path, config(groups_per_step=1))
    put((0.0, 1.0), "code")  # code's best group mean: 0.5
    step(trainer)
    assert trainer.version == 1
    for _ in range(SIGNAL_WINDOW):  # flat groups are consumed without a step
        put((1.0, 1.0), "web")
        put((0.2, 0.2), "code")
        step(trainer)
        step(trainer)
    assert trainer.store.buffer_depth == 0 and trainer.version == 1
    by_task = trainer.figures.signal_by_task()
    assert by_task["web"] == (1.0, "solved") and by_task["code"][1] == "collapsed"
    text = shown(trainer.figures)
    assert "policy/code: no learning signal: 100% of the last 64 groups" in text
    assert "policy/web: 100% of the last 64 groups scored the best reward" in text

    one = TrainerFigures()
    for _ in range(SIGNAL_WINDOW):
        one.note_consumed("arith", informative=False, mean=0.2)
    one.note_consumed("arith", informative=True, mean=0.5)
    text = shown(one)
    assert "policy: no learning signal: 98% of the last 64 groups" in text, \
        "a server with one task is named by its model alone"

