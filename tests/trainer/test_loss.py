"""The FlowGRPO loss functions against the formula written out by hand (autograd on both)."""

from __future__ import annotations

import torch

from flowgrpo.services.trainer.loss import (
    clipped_surrogate,
    effective_sample_size,
    flow_grpo_terms,
    importance_weights,
    kl_to_reference,
)


def test_loss_and_gradient_equal_the_hand_written_formula() -> None:
    torch.manual_seed(0)
    logp_old = torch.randn(12) * 0.01
    advantages = torch.tensor([2.0, -1.0, 0.5, 3.0, -2.5, 0.1, 1.0, -0.3, 0.7, 4.0, -4.0, 0.2])  # not centred
    eps = 1e-3
    shift = torch.randn(12) * 2e-3  # some ratios inside the band, some outside
    logp_a = (logp_old + shift).requires_grad_(True)
    logp_b = (logp_old + shift).requires_grad_(True)
    mask = torch.ones(12, dtype=torch.bool)
    mask[-2:] = False  # padding rows never count
    terms = flow_grpo_terms(logp_a, logp_old, advantages, mask, clip_eps=eps)
    (terms.loss_sum / terms.count).backward()

    ratio = torch.exp(logp_b - logp_old)
    per = torch.maximum(-advantages * ratio, -advantages * torch.clamp(ratio, 1 - eps, 1 + eps))
    (per[:10].sum() / 10).backward()
    assert terms.count == 10
    torch.testing.assert_close(terms.loss_sum / terms.count, per[:10].mean().detach(), rtol=1e-6, atol=1e-9)
    torch.testing.assert_close(logp_a.grad, logp_b.grad, rtol=1e-6, atol=1e-9)
    assert logp_a.grad is not None and torch.equal(logp_a.grad[-2:], torch.zeros(2))


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
    w = importance_weights(prox, behaviour, lag=torch.tensor([0, 1, 2]), cap=2.0)
    assert w[0] == 1.0  # lag 0: exactly the sync loss
    assert torch.isclose(w[1], torch.exp(torch.tensor(0.5))) and w[2] == 2.0
    assert effective_sample_size(torch.ones(5)) == 1.0
    assert effective_sample_size(torch.tensor([1.0, 0.0, 0.0, 0.0])) == 0.25


def test_kl_to_reference_formula() -> None:
    mean, ref = torch.ones(2, 3, 4), torch.zeros(2, 3, 4)
    std = torch.tensor([0.5, 2.0])
    torch.testing.assert_close(kl_to_reference(mean, ref, std), torch.tensor([1 / 0.5, 1 / 8.0]))
