"""A trainer on builtin:tiny with a real store in a temporary folder, and groups to feed it."""

from __future__ import annotations

import threading
from pathlib import Path
from typing import Any

import torch

from jetctl.proto.convert import group_to_pb
from jetctl.recipe import CheckpointConfig, ModelConfig, OptimizerConfig, TrainConfig
from jetctl.server.step import load_trainable
from jetctl.server.store import TrajectoryStore
from jetctl.server.trainer import Trainer
from jetctl.types import TrajectoryGroup
from tests.factories import make_group

PROMPT = (11, 12, 13, 14, 15, 16)


def config(**train: Any) -> ModelConfig:
    checkpoint = train.pop("checkpoint", CheckpointConfig(every_steps=1000))
    finetune = train.pop("finetune", "full")
    return ModelConfig(
        model="builtin:tiny", finetune=finetune, optimizer=OptimizerConfig(lr=1e-2),
        train=TrainConfig(**{"groups_per_step": 1, "max_staleness": 1, **train}),
        checkpoint=checkpoint,
    )


def make_trainer(tmp_path: Path, cfg: ModelConfig, checkpoint_dir: str | None = None,
                 model: Any = None) -> Trainer:
    if model is None:
        model, _ = load_trainable(cfg, attn_implementation="sdpa")
    store = TrajectoryStore(tmp_path / "store.sqlite")
    trainer = Trainer(
        model, cfg, store, weights_lock=threading.Lock(),
        checkpoint_dir=checkpoint_dir or str(tmp_path / "checkpoints"),
        steps_log=tmp_path / "steps.jsonl",
    )
    store.open(trained_through_step=trainer.resume())
    return trainer


def submit(trainer: Trainer, rewards: tuple[float, ...] = (0.0, 1.0),
           version: int | None = None) -> TrajectoryGroup:
    """Store a group as Submit would have accepted it (made at `version`, default: now)."""
    g = make_group(rewards=rewards, version=trainer.version if version is None else version,
                   prompt=PROMPT, completion=(21, 22, 23))
    assert trainer.store.put(g, group_to_pb(g).SerializeToString()).result(5).outcome == "accepted"
    return g


def step(trainer: Trainer) -> dict[str, float] | None:
    return trainer.step_once(wait_s=0.1)


def weights(model: Any) -> dict[str, torch.Tensor]:
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


def same_weights(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> bool:
    return a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
