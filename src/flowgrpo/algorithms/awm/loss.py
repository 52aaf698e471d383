"""Advantage Weighted Matching's objective as small pure functions.

Xue et al., "Advantage Weighted Matching: Aligning RL with Pretraining in Diffusion Models" (2025);
the equations and the reference code's constants are in docs/algorithms.md. Per sample and trained
time t: x_t = (1 - t) x0 + t eps is the clean latent noised again, and the current velocity v is
matched to the flow-matching target eps - x0 as in pretraining; the matching loss is
t ((mse + 1e-10)^p - 1e-10^p) / p of the per-sample mse (the reference's "ghuber" weighting), and
each sample's loss is weighted by its advantage A in [-1, 1]: a descent step fits the good images
better and the bad ones worse. Optional pulls toward the reference policy and toward an average of
the past policies are velocity distances mean((v - v_other)^2).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

FLOOR = 1e-10  # the reference's offset inside the power: a finite gradient at a perfect match


@dataclass(frozen=True)
class AwmTargets:
    """What one micro-batch's matching loss compares the current velocity with."""

    x0: Tensor  # [B, N, C] the clean latent the rollout produced
    eps: Tensor  # [B, N, C] the noise it was noised with: x_t = (1 - t) x0 + t eps
    t: Tensor  # [B]
    advantage: Tensor  # [B] the weight A in [-1, 1]
    mask: Tensor  # [B] 0 for padding rows


@dataclass(frozen=True)
class AwmTerms:
    loss_sum: Tensor  # sum over valid entries of A L (+ the KL pulls), differentiable
    policy_loss_sum: Tensor  # sum of A L, detached
    matching_sum: Tensor  # sum of L: how well the policy fits its own samples, detached
    kl_sum: Tensor  # sum of mean((v - v_ref)^2), detached (0 without the term)
    ema_kl_sum: Tensor  # sum of mean((v - v_ema)^2), detached (0 without the term)
    count: Tensor  # valid entries


def matching_loss(v: Tensor, targets: AwmTargets, power: float) -> Tensor:
    """Per-sample t ((mse + 1e-10)^p - 1e-10^p) / p [B], mse = mean((v - (eps - x0))^2), in
    float64 as the reference computes it; at p = 1 it is t mse."""
    error = v.double() - (targets.eps.double() - targets.x0.double())
    mse = (error**2).flatten(1).mean(dim=1)
    shaped: Tensor = (mse + FLOOR) ** power - FLOOR**power
    return targets.t.double() * shaped / power


def velocity_distance(v: Tensor, v_other: Tensor) -> Tensor:
    """Per-sample mean((v - v_other)^2) [B] in float64; v_other carries no gradient."""
    return ((v.double() - v_other.detach().double()) ** 2).flatten(1).mean(dim=1)


def awm_terms(
    v: Tensor,
    targets: AwmTargets,
    *,
    power: float,
    kl: Tensor | None = None,
    kl_beta: float = 0.0,
    ema_kl: Tensor | None = None,
    ema_kl_beta: float = 0.0,
) -> AwmTerms:
    """Sums over the valid entries of one micro-batch (v [B, N, C]); divide by the mini-batch's
    entry count for the mean loss. ``kl`` and ``ema_kl`` are per-sample velocity distances [B]."""
    valid = targets.mask.double()
    matching = matching_loss(v, targets, power)
    weighted = targets.advantage.double() * matching
    per_entry = weighted
    if kl is not None:
        per_entry = per_entry + kl_beta * kl
    if ema_kl is not None:
        per_entry = per_entry + ema_kl_beta * ema_kl
    zero = torch.zeros((), dtype=torch.float64, device=v.device)
    return AwmTerms(
        loss_sum=(per_entry * valid).sum(),
        policy_loss_sum=(weighted.detach() * valid).sum(),
        matching_sum=(matching.detach() * valid).sum(),
        kl_sum=(kl.detach() * valid).sum() if kl is not None else zero,
        ema_kl_sum=(ema_kl.detach() * valid).sum() if ema_kl is not None else zero,
        count=valid.sum(),
    )
