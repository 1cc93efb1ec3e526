"""RLOO: REINFORCE with a leave-one-out baseline, under the PPO-clip surrogate.

Kool et al. 2019 ("Buy 4 REINFORCE samples, get a baseline for free!"); Ahmadian et al.
2024 ("Back to Basics: Revisiting REINFORCE Style Optimization ... in LLMs"), eq. 6:

    A_i      = r_i - 1/(G-1) sum_{j != i} r_j  =  G/(G-1) (r_i - mean(r))
    L        = the GRPO loss with these advantages (PPO-clip on behaviour logprobs,
               token mean over the step, optional KL to the reference)

Each rollout's baseline is the mean of the other G-1 rewards of its group: unbiased (it
does not depend on the rollout's own sample) and, unlike GRPO, not divided by std(r). The
surrogate and aggregation are GRPO's (jetctl takes one optimizer step per batch, so the
ratio only corrects for staleness and the engine/trainer gap, as in TRL's RLOO). A group
of one rollout has no baseline: advantage 0.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from jetctl.server.algorithms.base import LossStats, StepTotals
from jetctl.server.algorithms.grpo import grpo_loss

if TYPE_CHECKING:
    from jetctl.recipe import TrainConfig


def leave_one_out_advantages(rewards: Sequence[float]) -> list[float]:
    """r_i - mean of the others' rewards; zeros for a group of one or of equal rewards."""
    g = len(rewards)
    if g < 2 or max(rewards) - min(rewards) < 1e-9:
        return [0.0] * g
    total = sum(rewards)
    return [r - (total - r) / (g - 1) for r in rewards]


@dataclass(frozen=True)
class RLOO:
    """`train.algorithm: rloo`."""

    clip_eps: float = 0.2
    kl_coef: float = 0.0
    name: str = "rloo"

    def advantages(self, rewards: Sequence[float]) -> list[float]:
        return leave_one_out_advantages(rewards)

    def loss(
        self,
        new_logprobs: torch.Tensor,
        old_logprobs: torch.Tensor,
        advantages: torch.Tensor,
        seq_index: torch.Tensor,
        totals: StepTotals,
        ref_logprobs: torch.Tensor | None = None,
        weights: torch.Tensor | None = None,
    ) -> tuple[torch.Tensor, LossStats]:
        return grpo_loss(
            new_logprobs, old_logprobs, advantages, clip_eps=self.clip_eps,
            normalizer=totals.tokens, ref_logprobs=ref_logprobs, kl_coef=self.kl_coef,
            weights=weights,
        )


def from_config(train: TrainConfig) -> RLOO:
    return RLOO(clip_eps=train.clip_eps, kl_coef=train.kl_coef)
