"""GRPO: group-normalized advantages with the PPO-clip surrogate on behaviour logprobs.

Shao et al. 2024 (DeepSeekMath), eq. 3, with the token-mean aggregation of DAPO (Yu et
al. 2025): every generated token of the step weighs the same, which keeps merged and
naive training exactly equal (the set of scored tokens does not depend on packing).

    A_i      = (r_i - mean(r)) / (std(r) + eps)          over a group of G rollouts
    ratio_t  = exp(logp_new_t - logp_old_t)               logp_old: behaviour logprobs
    kl_t     = exp(logp_ref_t - logp_new_t) - (logp_ref_t - logp_new_t) - 1
    L        = -sum_t [min(ratio_t A_t, clip(ratio_t, 1-eps_c, 1+eps_c) A_t) - beta kl_t] / N

kl_t is DeepSeekMath's eq. 4 (Schulman's k3 estimator of KL(new || ref), unbiased and never
negative) against the reference policy; beta is `train.kl_coef`, and the term is left out
when beta is 0 or no reference logprobs are given. Moderately stale tokens are corrected by
the ratio; very stale groups never get here (the staleness gate).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch


def group_advantages(rewards: list[float], eps: float = 1e-6) -> list[float]:
    """(r - mean) / (std + eps); a zero-variance group gets zeros (nothing to learn)."""
    n = len(rewards)
    mean = sum(rewards) / n
    var = sum((r - mean) ** 2 for r in rewards) / n
    std = math.sqrt(var)
    if std < 1e-8:
        return [0.0] * n
    return [(r - mean) / (std + eps) for r in rewards]


@dataclass
class LossStats:
    clip_fraction: float
    ratio_mean: float
    ratio_min: float
    ratio_max: float
    approx_kl: float  # k3 estimator of KL(old || new) on the scored tokens
    ref_kl: float = 0.0  # mean kl_t against the reference policy (0 without one)


def grpo_loss(
    new_logprobs: torch.Tensor,  # [N]
    old_logprobs: torch.Tensor,  # [N]
    advantages: torch.Tensor,  # [N]
    *,
    clip_eps: float,
    normalizer: int,  # scored tokens in the whole optimizer step (all micro-batches)
    ref_logprobs: torch.Tensor | None = None,  # [N] under the reference policy, no grad
    kl_coef: float = 0.0,  # beta
) -> tuple[torch.Tensor, LossStats]:
    # clamp before exp: a token whose probability moved by e^20 is clipped anyway, and an
    # unclamped exp overflows to inf (then NaN gradients) on a very stale token
    log_ratio = torch.clamp(new_logprobs - old_logprobs, -20.0, 20.0)
    ratio = torch.exp(log_ratio)
    unclipped = ratio * advantages
    clipped = torch.clamp(ratio, 1.0 - clip_eps, 1.0 + clip_eps) * advantages
    objective = torch.minimum(unclipped, clipped)
    kl: torch.Tensor | None = None
    if ref_logprobs is not None and kl_coef > 0:
        log_ref_ratio = torch.clamp(ref_logprobs - new_logprobs, -20.0, 20.0)
        kl = torch.exp(log_ref_ratio) - log_ref_ratio - 1.0
        objective = objective - kl_coef * kl
    loss = -objective.sum() / normalizer
    with torch.no_grad():
        r = ratio.detach()
        stats = LossStats(
            clip_fraction=float(((r - 1.0).abs() > clip_eps).float().mean()) if r.numel() else 0.0,
            ratio_mean=float(r.mean()) if r.numel() else 1.0,
            ratio_min=float(r.min()) if r.numel() else 1.0,
            ratio_max=float(r.max()) if r.numel() else 1.0,
            approx_kl=float(((r - 1) - log_ratio.detach()).mean()) if r.numel() else 0.0,
            ref_kl=float(kl.detach().mean()) if kl is not None and kl.numel() else 0.0,
        )
    return loss, stats
