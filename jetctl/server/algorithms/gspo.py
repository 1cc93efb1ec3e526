"""GSPO: the importance ratio and its clipping per sequence, not per token.

Zheng et al. 2025, "Group Sequence Policy Optimization", eqs. 5-7:

    A_i      = (r_i - mean(r)) / std(r)                   group-normalized, as GRPO
    s_i      = exp( 1/|y_i| sum_t (logp_new_it - logp_old_it) )   length-normalized
    L        = -sum_i [w_i min(s_i A_i, clip(s_i, 1 - eps_low, 1 + eps_high) A_i)
                       - beta mean_t kl_it] / S

A token-level ratio is a one-sample importance weight per token, whose noise grows with
length; the sequence's ratio matches the sequence-level reward. Because s_i is a mean of
log ratios it sits close to 1, so the clip range is two orders smaller than PPO's: the
paper's eps_low 3e-4, eps_high 4e-4 (`CLIP_EPS_LOW`, `CLIP_EPS_HIGH`; the recipe refuses
`clip_eps` with gspo rather than ignore it). S is the number of training sequences in the
step. y_i is a training sequence: one LLM call, or a timeline of calls merged into one
(`train.merge`), so for multi-call rollouts the unit of the ratio follows the merge mode.
w_i (TIS, `train.tis_cap`) is the mean of the sequence's token weights; kl_t and beta
(`train.kl_coef`) as in GRPO, averaged over the sequence.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from jetctl.server.algorithms.base import (
    LOG_RATIO_LIMIT,
    LossStats,
    StepTotals,
    k3_kl,
    token_stats,
)
from jetctl.server.algorithms.grpo import group_advantages

if TYPE_CHECKING:
    from jetctl.recipe import TrainConfig

CLIP_EPS_LOW = 3e-4
CLIP_EPS_HIGH = 4e-4


def sequence_mean(values: torch.Tensor, inverse: torch.Tensor, count: torch.Tensor) -> torch.Tensor:
    """Mean of `values` [N] per sequence: [S], given each token's sequence `inverse` [N]."""
    total = torch.zeros(count.shape[0], dtype=values.dtype, device=values.device)
    return total.index_add(0, inverse, values) / count


def gspo_loss(
    new_logprobs: torch.Tensor,  # [N]
    old_logprobs: torch.Tensor,  # [N]
    advantages: torch.Tensor,  # [N], the same for every token of a sequence
    seq_index: torch.Tensor,  # [N]
    *,
    normalizer: float,  # S: training sequences in the whole step
    clip_eps_low: float = CLIP_EPS_LOW,
    clip_eps_high: float = CLIP_EPS_HIGH,
    ref_logprobs: torch.Tensor | None = None,  # [N]
    kl_coef: float = 0.0,  # beta
    weights: torch.Tensor | None = None,  # [N] token weights, no grad
) -> tuple[torch.Tensor, LossStats]:
    _, inverse = torch.unique(seq_index, return_inverse=True)  # [N] -> 0..S'-1
    count = torch.bincount(inverse).to(new_logprobs.dtype)  # [S'] tokens per sequence
    token_log_ratio = torch.clamp(new_logprobs - old_logprobs, -LOG_RATIO_LIMIT, LOG_RATIO_LIMIT)
    log_ratio = sequence_mean(token_log_ratio, inverse, count)  # [S']
    ratio = torch.exp(log_ratio)  # s_i
    adv = torch.zeros_like(ratio).scatter(0, inverse, advantages.to(ratio.dtype))  # [S'] A_i
    unclipped = ratio * adv
    clipped = torch.clamp(ratio, 1.0 - clip_eps_low, 1.0 + clip_eps_high) * adv
    objective = torch.minimum(unclipped, clipped)  # [S']
    if weights is not None:
        objective = sequence_mean(weights.to(ratio.dtype), inverse, count) * objective
    kl: torch.Tensor | None = None
    if ref_logprobs is not None and kl_coef > 0:
        kl = k3_kl(new_logprobs, ref_logprobs)  # [N]
        objective = objective - kl_coef * sequence_mean(kl, inverse, count)
    loss = -objective.sum() / normalizer
    r = ratio.detach()
    outside = (r < 1.0 - clip_eps_low) | (r > 1.0 + clip_eps_high)
    return loss, token_stats(ratio, log_ratio, outside, kl)


@dataclass(frozen=True)
class GSPO:
    """`train.algorithm: gspo`."""

    clip_eps_low: float = CLIP_EPS_LOW
    clip_eps_high: float = CLIP_EPS_HIGH
    kl_coef: float = 0.0
    name: str = "gspo"

    def advantages(self, rewards: Sequence[float]) -> list[float]:
        return group_advantages(rewards)

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
        return gspo_loss(
            new_logprobs, old_logprobs, advantages, seq_index, normalizer=totals.sequences,
            clip_eps_low=self.clip_eps_low, clip_eps_high=self.clip_eps_high,
            ref_logprobs=ref_logprobs, kl_coef=self.kl_coef, weights=weights,
        )


def from_config(train: TrainConfig) -> GSPO:
    return GSPO(kl_coef=train.kl_coef)
