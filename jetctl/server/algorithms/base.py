"""What every algorithm shares: the `Algorithm` protocol, the step's totals, the loss stats.

An algorithm is two functions (the step, `jetctl/server/step.py`, calls them; so can any
loop that lays its tokens out itself, e.g. `jetctl/bench/sync_loop.py`):

    advantages(rewards) -> one advantage per rollout of a group
    loss(new_logprobs, old_logprobs, advantages, seq_index, totals, ref_logprobs, weights)
        -> (the micro-batch's share of the step's loss, LossStats)

All tensors are flat over a micro-batch's N scored tokens. `old_logprobs` are the
behaviour logprobs (the engine's, recorded at generation). `seq_index` says which training
sequence each token belongs to (a sequence never spans micro-batches), for losses that
reduce per sequence. `totals` are counts over the whole optimizer step, so a loss summed
over its micro-batches equals the loss of the step computed at once. `weights` are per-token
importance weights without gradient (truncated importance sampling, `train.tis_cap`).

Algorithms share these data types and small helpers, not a base class.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Protocol

import torch

LOG_RATIO_LIMIT = 20.0  # clamp before exp: beyond e^20 the token is clipped anyway; inf -> NaN


@dataclass(frozen=True)
class StepTotals:
    """Counts over every micro-batch of one optimizer step (the losses' normalizers)."""

    tokens: int  # scored (generated) tokens
    sequences: int  # training sequences (after timeline merging)
    trajectories: int  # rollouts with at least one scored token


@dataclass
class LossStats:
    clip_fraction: float
    ratio_mean: float
    ratio_min: float
    ratio_max: float
    approx_kl: float  # k3 estimator of KL(old || new) on the scored tokens
    ref_kl: float = 0.0  # mean kl_t against the reference policy (0 without one)


class Algorithm(Protocol):
    """A policy-gradient algorithm: its advantages and its loss (module docstring)."""

    name: str

    def advantages(self, rewards: Sequence[float]) -> list[float]: ...

    def loss(
        self,
        new_logprobs: torch.Tensor,  # [N], with gradient
        old_logprobs: torch.Tensor,  # [N] behaviour logprobs
        advantages: torch.Tensor,  # [N] the advantage of each token's rollout
        seq_index: torch.Tensor,  # [N] the training sequence of each token
        totals: StepTotals,
        ref_logprobs: torch.Tensor | None = None,  # [N] under the reference policy, no grad
        weights: torch.Tensor | None = None,  # [N] per-token importance weights, no grad
    ) -> tuple[torch.Tensor, LossStats]: ...


def k3_kl(new_logprobs: torch.Tensor, ref_logprobs: torch.Tensor) -> torch.Tensor:
    """kl_t = exp(ref - new) - (ref - new) - 1: Schulman's k3 estimator of KL(new || ref),
    unbiased and never negative (DeepSeekMath eq. 4). [N]"""
    log_ref_ratio = torch.clamp(ref_logprobs - new_logprobs, -LOG_RATIO_LIMIT, LOG_RATIO_LIMIT)
    return torch.exp(log_ref_ratio) - log_ref_ratio - 1.0


def token_stats(
    ratio: torch.Tensor, log_ratio: torch.Tensor, clipped: torch.Tensor,
    kl: torch.Tensor | None,
) -> LossStats:
    """The step-log figures of one micro-batch: `clipped` marks tokens outside the trust
    region; `ratio` and `log_ratio` are per token (detached here)."""
    with torch.no_grad():
        r = ratio.detach()
        if not r.numel():
            return LossStats(0.0, 1.0, 1.0, 1.0, 0.0, 0.0)
        return LossStats(
            clip_fraction=float(clipped.float().mean()),
            ratio_mean=float(r.mean()),
            ratio_min=float(r.min()),
            ratio_max=float(r.max()),
            approx_kl=float(((r - 1) - log_ratio.detach()).mean()),
            ref_kl=float(kl.detach().mean()) if kl is not None and kl.numel() else 0.0,
        )


def group_mean_baseline(rewards: Sequence[float]) -> list[float]:
    """r_i - mean(r): the advantage without std normalization (Dr. GRPO); a flat group gets 0."""
    if max(rewards) - min(rewards) < 1e-9:
        return [0.0] * len(rewards)  # exactly: the trainer skips all-zero groups
    mean = sum(rewards) / len(rewards)
    return [r - mean for r in rewards]


def tis_weights(
    trainer_logprobs: torch.Tensor, engine_logprobs: torch.Tensor, cap: float
) -> torch.Tensor:
    """w_t = min(exp(logp_trainer_t - logp_engine_t), C), without gradient: truncated
    importance sampling (Yao et al. 2025) for the gap between the trainer's and the engine's
    logprobs of the same tokens. [N]"""
    with torch.no_grad():
        log_w = torch.clamp(trainer_logprobs.detach() - engine_logprobs, max=math.log(cap))
        return torch.exp(log_w)
