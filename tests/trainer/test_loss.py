"""The FlowGRPO loss functions against definitions written another way than the code: the PPO
paper's objective resolved by the advantage's sign, its derivative by cases, finite differences,
and torch's Gaussian KL."""

from __future__ import annotations

import math

import pytest
import torch
from torch.distributions import Normal, kl_divergence

from flowgrpo.algorithms.flow_grpo.loss import (
    clipped_surrogate,
    effective_sample_size,
    flow_grpo_terms,
    importance_weights,
    kl_to_reference,
)

EPS = 1e-3
# log-ratios on both sides of the band [log(1 - EPS), log(1 + EPS)] ~ [-1.0e-3, 1.0e-3], never on an edge
LOG_RATIOS = [-3e-3, -1.5e-3, -4e-4, 0.0, 6e-4, 1.6e-3, 2.5e-3, -2e-3, 3e-4, 1.2e-3, -8e-4, 4e-3]
ADVANTAGES = [2.0, -1.0, 0.5, 3.0, -2.5, 0.1, -1.0, 0.3, -0.7, 4.0, -4.0, 0.2]  # not centred


def ppo_objective(ratio: float, advantage: float) -> tuple[float, float]:
    """PPO's min(r A, clip(r, 1 - eps, 1 + eps) A) for one entry, resolved by cases: for A >= 0
    it is A min(r, 1 + eps), for A < 0 it is A max(r, 1 - eps). Returns the objective and its
    derivative in log r (A r where r is not capped, 0 where it is)."""
    if advantage >= 0:
        return advantage * min(ratio, 1 + EPS), advantage * ratio if ratio < 1 + EPS else 0.0
    return advantage * max(ratio, 1 - EPS), advantage * ratio if ratio > 1 - EPS else 0.0


@pytest.mark.parametrize("weighted", [False, True], ids=["on-policy", "importance-weighted"])
def test_loss_and_gradient_are_the_negated_ppo_objective(weighted: bool) -> None:
    """loss = -mean over valid entries of w * objective (w = 1 on-policy; the decoupled loss
    multiplies each entry by its importance weight, a constant of the gradient)."""
    torch.manual_seed(0)
    logp_old = torch.randn(12, dtype=torch.float64) * 0.01
    logp = (logp_old + torch.tensor(LOG_RATIOS, dtype=torch.float64)).requires_grad_(True)
    advantages = torch.tensor(ADVANTAGES, dtype=torch.float64)
    w = [0.5 + i / 8 for i in range(12)] if weighted else [1.0] * 12
    mask = torch.ones(12, dtype=torch.bool)
    mask[-2:] = False  # padding rows never count
    weights = torch.tensor(w, dtype=torch.float64) if weighted else None
    terms = flow_grpo_terms(logp, logp_old, advantages, mask, clip_eps=EPS, weights=weights)
    (terms.loss_sum / terms.count).backward()

    valid = [ppo_objective(math.exp(lr), a) for lr, a in zip(LOG_RATIOS[:10], ADVANTAGES[:10], strict=True)]
    assert terms.count == 10
    expected_loss = -sum(wi * obj for wi, (obj, _) in zip(w[:10], valid, strict=True)) / 10
    assert float(terms.loss_sum.detach()) / 10 == pytest.approx(expected_loss, rel=1e-12)
    expected_grad = [-wi * d / 10 for wi, (_, d) in zip(w[:10], valid, strict=True)] + [0.0, 0.0]
    assert logp.grad is not None
    torch.testing.assert_close(
        logp.grad, torch.tensor(expected_grad, dtype=torch.float64), rtol=1e-12, atol=0
    )
    assert float(terms.clipped) == sum(d == 0.0 for _, d in valid) == 3  # pg_clipfrac: the capped entries
    assert float(terms.pg_loss_sum) == float(terms.loss_sum.detach())  # no KL term


def test_gradient_matches_finite_differences() -> None:
    """float64, away from the band's edges (the surrogate is piecewise smooth)."""
    logp_old = torch.zeros(12, dtype=torch.float64)
    logp = torch.tensor(LOG_RATIOS, dtype=torch.float64, requires_grad=True)
    advantages = torch.tensor(ADVANTAGES, dtype=torch.float64)
    weights = torch.linspace(0.5, 1.5, 12, dtype=torch.float64)
    mask = torch.ones(12, dtype=torch.bool)

    def loss(x: torch.Tensor) -> torch.Tensor:
        return flow_grpo_terms(x, logp_old, advantages, mask, clip_eps=EPS, weights=weights).loss_sum

    assert torch.autograd.gradcheck(loss, (logp,), eps=1e-7, atol=1e-8)


def test_clipping_engages_only_outside_the_band() -> None:
    logp_old = torch.zeros(4)
    logp = torch.tensor([0.0, 1e-6, 0.1, -0.1])
    advantages = torch.tensor([1.0, 1.0, 1.0, -1.0])
    loss, clipped = clipped_surrogate(logp, logp_old, advantages, clip_eps=1e-3)
    assert clipped.tolist() == [False, False, True, True]
    # where the clip is active the loss is flat in logp: no gradient pushes the ratio further
    x = logp.clone().requires_grad_(True)
    clipped_surrogate(x, logp_old, advantages, clip_eps=1e-3)[0].sum().backward()
    assert x.grad is not None and x.grad[2] == 0 and x.grad[3] == 0 and x.grad[0] != 0
    assert torch.allclose(loss[2], torch.tensor(-(1 + 1e-3)))


def test_importance_weights_are_one_on_policy_and_truncated() -> None:
    prox, behaviour = torch.tensor([0.0, 0.5, 3.0]), torch.tensor([0.1, 0.0, 0.0])
    w = importance_weights(prox, behaviour, off_policy=torch.tensor([False, True, True]), cap=2.0)
    assert w[0] == 1.0  # lag 0 from a rollout in the trainer's precision: exactly the sync loss
    assert torch.isclose(w[1], torch.exp(torch.tensor(0.5))) and w[2] == 2.0
    assert effective_sample_size(torch.ones(5)) == 1.0
    assert effective_sample_size(torch.tensor([1.0, 0.0, 0.0, 0.0])) == 0.25


def test_kl_to_reference_is_the_gaussian_kl_for_a_shared_std() -> None:
    """KL(N(mean, std^2) || N(mean_ref, std^2)) per element from torch.distributions, averaged
    over each sample's elements; 0 when the means agree."""
    torch.manual_seed(1)
    mean, ref = torch.randn(3, 4, 8, dtype=torch.float64), torch.randn(3, 4, 8, dtype=torch.float64)
    std = torch.tensor([0.5, 2.0, 0.1], dtype=torch.float64)
    scale = std.view(-1, 1, 1).expand_as(mean)
    expected = kl_divergence(Normal(mean, scale), Normal(ref, scale)).mean(dim=(1, 2))
    torch.testing.assert_close(kl_to_reference(mean, ref, std), expected, rtol=1e-12, atol=0)
    assert torch.equal(kl_to_reference(ref, ref, std), torch.zeros(3, dtype=torch.float64))
