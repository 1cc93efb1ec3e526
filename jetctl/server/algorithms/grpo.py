"""GRPO: group-normalized advantages with the PPO-clip surrogate on behaviour logprobs.

Shao et al. 2024 (DeepSeekMath), eq. 3, with the token-mean aggregation of DAPO (Yu et
al. 2025): every generated token of the step weighs the same, which keeps merged and
naive training exactly equal (the set of scored tokens does not depend on packing).

    A_i      = (r_i - mean(r)) / (std(r) + eps)          over a group of G rollouts
    ratio_t  = exp(logp_new_t - logp_old_t)               logp_old: behaviour logprobs
    kl_t     = exp(logp_ref_t - logp_new_t) - (logp_ref_t - logp_new_t) - 1
    L        = -sum_t [w_t min(ratio_t A_t, clip(ratio_t, 1-eps_c, 1+eps_c) A_t) - beta kl_t] / N

kl_t is DeepSeekMath's eq. 4 (Schulman's k3 estimator of KL(new || ref), unbiased and never
negative) against the reference policy; beta is `train.kl_coef`, and the term is left out
when beta is 0 or no reference logprobs are given. w_t is 1 unless truncated importance
sampling is on (`train.tis_cap`, jetctl/server/step.py). N is the step's scored tokens.
Moderately stale tokens are corrected by the ratio; very stale groups never get here (the
staleness gate).
"""

from __future__ import annotations

import math
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

if TYPE_CHECKING:
    from jetctl.recipe import TrainConfig


def group_advantages(rewards: Sequence[float], eps: float = 1e-6) -> list[float]:
    """(r - mean) / (std + eps); a zero-variance group gets zeros (nothing to learn)."""
    n = len(rewards)
    mean = sum(rewards) / n
    var = sum((r - mean) ** 2 for r in rewards) / n
    std = math.sqrt(var)
    if std < 1e-8:
        return [0.0] * n
    return [(r - mean) / (std + eps) for r in rewards]


def grpo_loss(
    new_logprobs: torch.Tensor,  # [N]
    old_logprobs: torch.Tensor,  # [N]
    advantages: torch.Tensor,  # [N]
    *,
    clip_eps: float,
    normalizer: float,  # scored tokens in the whole optimizer step (all micro-batches)
    ref_logprobs: torch.Tensor | None = None,  # [N] under the reference policy, no grad
    kl_coef: float = 0.0,  # beta
    weights: torch.Tensor | None = None,  # [N] w_t, no grad (None: 1)
    clip_eps_high: float | None = None,  # DAPO's decoupled upper range (None: clip_eps)
) -> tuple[torch.Tensor, LossStats]:
    high = clip_eps if clip_eps_high is None else clip_eps_high
    log_ratio = torch.clamp(new_logprobs - old_logprobs, -LOG_RATIO_LIMIT, LOG_RATIO_LIMIT)
    ratio = torch.exp(log_ratio)
    unclipped = ratio * advantages
    clipped = torch.clamp(ratio, 1.0 - clip_eps, 1.0 + high) * advantages
    objective = torch.minimum(unclipped, clipped)
    if weights is not None:
        objective = weights * objective
    kl: torch.Tensor | None = None
    if ref_logprobs is not None and kl_coef > 0:
        kl = k3_kl(new_logprobs, ref_logprobs)
        objective = objective - kl_coef * kl
    loss = -objective.sum() / normalizer
    r = ratio.detach()
    outside = (r - 1.0).abs() > clip_eps if clip_eps_high is None \
        else (r < 1.0 - clip_eps) | (r > 1.0 + high)
    return loss, token_stats(ratio, log_ratio, outside, kl)


@dataclass(frozen=True)
class GRPO:
    """`train.algorithm: grpo`."""

    clip_eps: float = 0.2  # eps_c
    kl_coef: float = 0.0  # beta
    name: str = "grpo"

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
        return grpo_loss(
            new_logprobs, old_logprobs, advantages, clip_eps=self.clip_eps,
            normalizer=totals.tokens, ref_logprobs=ref_logprobs, kl_coef=self.kl_coef,
            weights=weights,
        )


def from_config(train: TrainConfig) -> GRPO:
    return GRPO(clip_eps=train.clip_eps, kl_coef=train.kl_coef)
