"""DAPO's loss: PPO-clip with a decoupled (higher) upper clip range, token-level over the step.

Yu et al. 2025, "DAPO: An Open-Source LLM Reinforcement Learning System at Scale", eq. 8:

    A_i      = (r_i - mean(r)) / std(r)                   group-normalized, as GRPO
    ratio_t  = exp(logp_new_t - logp_old_t)
    L        = -sum_t w_t min(ratio_t A_t, clip(ratio_t, 1 - eps_low, 1 + eps_high) A_t) / N

eps_low is `train.clip_eps` (0.2), eps_high `train.clip_eps_high` (null: DAPO's 0.28):
"clip-higher" lets a low-probability token that helped gain more before it is clipped,
which keeps entropy from collapsing. N counts every generated token of the step
("token-level policy gradient loss", their section 3.3): long and short rollouts weigh per
token. A KL term against the reference (beta = `train.kl_coef`) is added per token as in
GRPO; the paper drops it (kl_coef 0, the default).

The other parts of DAPO: dynamic sampling is the trainer's for every algorithm (groups
whose rewards are all equal never take a batch slot); overlong reward shaping is left to
the task's reward.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from jetctl.server.algorithms.base import LossStats, StepTotals
from jetctl.server.algorithms.grpo import group_advantages, grpo_loss

if TYPE_CHECKING:
    from jetctl.recipe import TrainConfig

CLIP_EPS_HIGH = 0.28  # eps_high of DAPO's experiments (eps_low 0.2)


@dataclass(frozen=True)
class DAPO:
    """`train.algorithm: dapo`."""

    clip_eps_low: float = 0.2
    clip_eps_high: float = CLIP_EPS_HIGH
    kl_coef: float = 0.0
    name: str = "dapo"

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
            new_logprobs, old_logprobs, advantages, clip_eps=self.clip_eps_low,
            clip_eps_high=self.clip_eps_high, normalizer=totals.tokens,
            ref_logprobs=ref_logprobs, kl_coef=self.kl_coef, weights=weights,
        )


def from_config(train: TrainConfig) -> DAPO:
    high = CLIP_EPS_HIGH if train.clip_eps_high is None else train.clip_eps_high
    return DAPO(clip_eps_low=train.clip_eps, clip_eps_high=high, kl_coef=train.kl_coef)
