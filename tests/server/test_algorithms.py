"""The algorithm registry and each algorithm's formula against a hand computation.

Every loss is checked on a few tokens whose ratios sit inside or outside the clip range,
against values written out by hand from the paper's equation (see each module's
docstring); gradients too where clipping decides them. The learning checks (reward rises
on builtin:tiny) are in test_algorithms_learn.py.
"""

from __future__ import annotations

import math

import pytest
import torch

from jetctl.recipe import TrainConfig
from jetctl.server import algorithms
from jetctl.server.algorithms.base import StepTotals, tis_weights
from jetctl.server.algorithms.dapo import DAPO
from jetctl.server.algorithms.dr_grpo import DrGRPO
from jetctl.server.algorithms.gspo import GSPO
from jetctl.server.algorithms.rloo import RLOO

pytestmark = pytest.mark.unit


def totals(tokens: int = 0, sequences: int = 0, trajectories: int = 0) -> StepTotals:
    return StepTotals(tokens=tokens, sequences=sequences, trajectories=trajectories)


def test_the_registry_makes_every_algorithm_the_recipe_accepts() -> None:
    assert algorithms.names() == ("grpo", "dr_grpo", "dapo", "gspo", "rloo")
    for name in algorithms.names():
        alg = algorithms.make(TrainConfig(algorithm=name))  # type: ignore[arg-type]
        assert alg.name == name
        assert alg.advantages([0.0, 0.0]) == [0.0, 0.0], "a flat group moves nothing"
    made = algorithms.make(TrainConfig(algorithm="dapo", clip_eps=0.1, clip_eps_high=0.3,
                                       kl_coef=0.05))
    assert made == DAPO(clip_eps_low=0.1, clip_eps_high=0.3, kl_coef=0.05)
    assert algorithms.make(TrainConfig(algorithm="dapo")) == DAPO(0.2, 0.28)


def test_dr_grpo_does_not_divide_by_std_or_by_length() -> None:
    # rewards 0, 1, 1: mean 2/3, so A = r - 2/3 (GRPO would divide by std 0.471 as well)
    assert DrGRPO().advantages([0.0, 1.0, 1.0]) == pytest.approx([-2 / 3, 1 / 3, 1 / 3])
    # on-policy (ratio 1), 3 tokens of 2 rollouts: L = -sum_t A_t / (M * L_max), M = 2
    new = torch.tensor([-1.0, -2.0, -0.5], requires_grad=True)
    adv = torch.tensor([1.0, 1.0, -0.5])
    loss, _ = DrGRPO(max_tokens=1024).loss(new, new.detach().clone(), adv, torch.tensor([0, 0, 1]),
                                           totals(tokens=3, sequences=2, trajectories=2))
    assert loss.item() == pytest.approx(-1.5 / 2048)
    loss.backward()
    assert new.grad is not None
    assert new.grad.tolist() == pytest.approx([-1 / 2048, -1 / 2048, 0.5 / 2048])


def test_dapo_clips_higher_above_than_below() -> None:
    # token 0: ratio e^0.22 = 1.246, A = +1: inside DAPO's [0.8, 1.28] (GRPO's 1.2 would clip)
    # token 1: ratio e^0.3 = 1.350, A = +1: clipped at 1.28, no gradient
    # token 2: ratio e^-0.3 = 0.741, A = -1: min(-0.741, -0.8) = -0.8, clipped, no gradient
    old = torch.zeros(3)
    new = torch.tensor([0.22, 0.3, -0.3], requires_grad=True)
    adv = torch.tensor([1.0, 1.0, -1.0])
    loss, st = DAPO(clip_eps_low=0.2, clip_eps_high=0.28).loss(
        new, old, adv, torch.tensor([0, 1, 2]), totals(tokens=4, sequences=3, trajectories=3))
    assert loss.item() == pytest.approx(-(math.exp(0.22) + 1.28 - 0.8) / 4)
    loss.backward()
    assert new.grad is not None
    assert new.grad.tolist() == pytest.approx([-math.exp(0.22) / 4, 0.0, 0.0])
    assert st.clip_fraction == pytest.approx(2 / 3)


def test_gspo_takes_one_length_normalized_ratio_per_sequence() -> None:
    # sequence 0: log ratios 2e-4 and 4e-4, mean 3e-4: s_0 = e^3e-4, inside [1-3e-4, 1+4e-4]
    # sequence 1: log ratio 1e-3: s_1 = 1.0010005 > 1 + 4e-4 with A = +1, clipped
    old = torch.zeros(3)
    new = torch.tensor([2e-4, 4e-4, 1e-3], dtype=torch.float64, requires_grad=True)
    adv = torch.tensor([1.0, 1.0, 1.0], dtype=torch.float64)
    loss, st = GSPO().loss(new, old.double(), adv, torch.tensor([0, 0, 1]),
                           totals(tokens=3, sequences=2, trajectories=2))
    assert loss.item() == pytest.approx(-(math.exp(3e-4) + 1.0004) / 2, rel=1e-12)
    loss.backward()
    assert new.grad is not None
    # d s_0 / d logp_t = s_0 / |y_0| for each of its 2 tokens; divided by S = 2
    s0 = math.exp(3e-4)
    assert new.grad.tolist() == pytest.approx([-s0 / 4, -s0 / 4, 0.0], rel=1e-12)
    assert st.clip_fraction == 0.5 and st.ratio_max == pytest.approx(math.exp(1e-3))


def test_rloo_baseline_leaves_each_rollout_out() -> None:
    # r = 1, 0, 0, 1: each 1's baseline is (0 + 0 + 1) / 3, each 0's is (1 + 0 + 1) / 3
    assert RLOO().advantages([1.0, 0.0, 0.0, 1.0]) == pytest.approx([2 / 3, -2 / 3, -2 / 3, 2 / 3])
    assert RLOO().advantages([0.5]) == [0.0], "a lone rollout has no baseline"
    # the loss is GRPO's token mean: on-policy L = -sum_t A_t / N
    new = torch.tensor([-1.0, -1.0], requires_grad=True)
    loss, _ = RLOO().loss(new, new.detach().clone(), torch.tensor([2 / 3, -2 / 3]),
                          torch.tensor([0, 1]), totals(tokens=4))
    assert loss.item() == pytest.approx(0.0, abs=1e-7)
    loss.backward()
    assert new.grad is not None and new.grad.tolist() == pytest.approx([-1 / 6, 1 / 6])


def test_tis_weights_are_the_trainer_engine_ratio_capped() -> None:
    trainer = torch.tensor([-1.0, -1.0, -1.0], requires_grad=True)
    engine = torch.tensor([-1.5, -0.2, -1.0])
    w = tis_weights(trainer, engine, cap=1.5)
    assert w.tolist() == pytest.approx([1.5, math.exp(-0.8), 1.0])  # e^0.5 = 1.65 capped
    assert not w.requires_grad
    # in a loss, w_t scales each token's term: GRPO on-policy L = -sum_t w_t A_t / N
    adv = torch.tensor([1.0, 1.0, -1.0])
    loss, _ = algorithms.make(TrainConfig()).loss(
        trainer, trainer.detach(), adv, torch.tensor([0, 0, 0]), totals(tokens=3), weights=w)
    assert loss.item() == pytest.approx(-(1.5 + math.exp(-0.8) - 1.0) / 3)
