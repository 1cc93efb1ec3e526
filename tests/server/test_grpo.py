"""GRPO advantages and the PPO-clip loss against hand-derived values."""

from __future__ import annotations

import math

import pytest
import torch

from jetctl.server.algorithms.grpo import group_advantages, grpo_loss

pytestmark = pytest.mark.unit


def test_advantages_are_group_normalized() -> None:
    # rewards 0, 1: mean 0.5, population std 0.5 -> -1, +1 (eps 1e-6 shifts the 6th digit)
    a = group_advantages([0.0, 1.0])
    assert a == pytest.approx([-1.0, 1.0], abs=1e-5)
    assert group_advantages([0.3, 0.3, 0.3]) == [0.0, 0.0, 0.0]


def test_loss_on_policy_equals_minus_mean_advantage() -> None:
    # ratio = 1 on-policy: L = -sum(A_t) / N, and dL/dlogp_t = -A_t / N
    new = torch.tensor([-1.0, -2.0, -0.5], requires_grad=True)
    adv = torch.tensor([1.0, -1.0, 2.0])
    loss, st = grpo_loss(new, new.detach().clone(), adv, clip_eps=0.2, normalizer=4)
    assert loss.item() == pytest.approx(-(1 - 1 + 2) / 4)
    loss.backward()
    assert new.grad is not None
    assert new.grad.tolist() == pytest.approx([-0.25, 0.25, -0.5])
    assert st.clip_fraction == 0.0 and st.ratio_mean == pytest.approx(1.0)


def test_clipping_stops_the_gradient_beyond_the_trust_region() -> None:
    # ratio e^0.5 = 1.65 > 1.2 with A > 0: the clipped term (1.2 * A) is the min -> no gradient
    old = torch.tensor([-1.0])
    new = torch.tensor([-0.5], requires_grad=True)
    loss, st = grpo_loss(new, old, torch.tensor([1.0]), clip_eps=0.2, normalizer=1)
    assert loss.item() == pytest.approx(-1.2)
    loss.backward()
    assert new.grad is not None and new.grad.item() == 0.0
    assert st.clip_fraction == 1.0 and st.ratio_max == pytest.approx(math.exp(0.5))


def test_extreme_log_ratio_stays_finite() -> None:
    # behaviour logprob -90 vs new -1: exp(89) overflows float32 without the clamp
    new = torch.tensor([-1.0, -1.0], requires_grad=True)
    loss, _ = grpo_loss(new, torch.tensor([-90.0, -1.0]), torch.tensor([1.0, -1.0]),
                        clip_eps=0.2, normalizer=2)
    loss.backward()
    assert torch.isfinite(loss) and new.grad is not None and torch.isfinite(new.grad).all()
