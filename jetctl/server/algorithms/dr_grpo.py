"""Dr. GRPO: GRPO without its two biases (no std normalization, a constant normalizer).

Liu et al. 2025, "Understanding R1-Zero-Like Training: A Critical Perspective", eq. 3:

    A_i      = r_i - mean(r)                              no division by std(r)
    ratio_t  = exp(logp_new_t - logp_old_t)
    L        = -sum_i sum_t [w_t min(ratio_t A_i, clip(ratio_t, 1-eps, 1+eps) A_i)
                             - beta kl_t] / (M * L_max)

Dividing by std(r) weighs groups whose rewards barely differ (too easy or too hard) most;
dividing each rollout by its own length |o_i| makes long wrong answers cost less per token.
Dr. GRPO drops both: M is the number of rollouts in the step and L_max a constant, the
generation budget in their code (`MAX_TOKENS` here: 1024 tokens per rollout). A constant
only scales the gradient, as the learning rate does (and AdamW nearly undoes a fixed scale),
so it is fixed here rather than a recipe field. kl_t and beta (`train.kl_coef`) as in GRPO.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from jetctl.server.algorithms.base import LossStats, StepTotals, group_mean_baseline
from jetctl.server.algorithms.grpo import grpo_loss

if TYPE_CHECKING:
    from jetctl.recipe import TrainConfig

MAX_TOKENS = 1024  # L_max: the constant generated tokens per rollout of the normalizer


@dataclass(frozen=True)
class DrGRPO:
    """`train.algorithm: dr_grpo`."""

    clip_eps: float = 0.2
    kl_coef: float = 0.0
    max_tokens: int = MAX_TOKENS  # L_max
    name: str = "dr_grpo"

    def advantages(self, rewards: Sequence[float]) -> list[float]:
        return group_mean_baseline(rewards)

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
            normalizer=totals.trajectories * self.max_tokens, ref_logprobs=ref_logprobs,
            kl_coef=self.kl_coef, weights=weights,
        )


def from_config(train: TrainConfig) -> DrGRPO:
    return DrGRPO(clip_eps=train.clip_eps, kl_coef=train.kl_coef)
