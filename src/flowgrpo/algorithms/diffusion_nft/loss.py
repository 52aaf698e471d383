"""DiffusionNFT's objective as small pure functions.

Zheng et al., "DiffusionNFT: Online Diffusion Reinforcement with Forward Process" (2025); the
equations and the reference code's constants are in docs/algorithms.md. Per sample and trained
time t: x_t = (1 - t) x0 + t eps; from the current velocity v and the old (sampling) policy's
v_old, the implicit positive policy v+ = beta v + (1 - beta) v_old and the implicit negative
v- = (1 + beta) v_old - beta v; each predicts x0 as x_t - t v; the loss regresses both onto the
clean x0, weighted by the optimality r in [0, 1]: r ||x0(v+) - x0||^2 + (1 - r) ||x0(v-) - x0||^2,
each squared error divided by its own (detached) mean absolute error (adaptive weighting),
all divided by beta and scaled by ``scale`` (the reference multiplies by its advantage clip).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor


@dataclass(frozen=True)
class NftTerms:
    loss_sum: Tensor  # sum over valid entries of the NFT loss (+ kl_beta * KL), differentiable
    policy_loss_sum: Tensor  # the same without the KL term, detached
    positive_sum: Tensor  # sum of the adaptive-weighted positive losses, detached
    negative_sum: Tensor  # ... negative
    old_deviation_sum: Tensor  # sum of mean((v - v_old)^2): how far training has moved from sampling
    count: Tensor  # valid entries


def implicit_velocities(v: Tensor, v_old: Tensor, beta: float) -> tuple[Tensor, Tensor]:
    """(v+, v-) = (beta v + (1 - beta) v_old, (1 + beta) v_old - beta v); v_old carries no gradient."""
    v_old = v_old.detach()
    return beta * v + (1.0 - beta) * v_old, (1.0 + beta) * v_old - beta * v


def adaptive_x0_loss(x0_pred: Tensor, x0: Tensor) -> Tensor:
    """Per-sample mean((x0_pred - x0)^2) / sg(mean|x0_pred - x0|) [B]; the weight in float64,
    floored at 1e-5, as the reference computes it."""
    error = x0_pred - x0
    with torch.no_grad():
        weight = error.double().abs().flatten(1).mean(dim=1).clamp(min=1e-5).to(error.dtype)
    return (error**2).flatten(1).mean(dim=1) / weight


@dataclass(frozen=True)
class NftTargets:
    """What one micro-batch's NFT loss compares the current velocity with."""

    v_old: Tensor  # [B, N, C] the old (sampling) policy's velocity at x_t, no gradient
    x0: Tensor  # [B, N, C] the clean latent the rollout produced
    x_t: Tensor  # [B, N, C] x0 noised to time t: (1 - t) x0 + t eps
    t: Tensor  # [B]
    optimality: Tensor  # [B] r in [0, 1]
    mask: Tensor  # [B] 0 for padding rows


def diffusion_nft_terms(
    v: Tensor,
    targets: NftTargets,
    *,
    beta: float,
    scale: float,
    kl: Tensor | None = None,
    kl_beta: float = 0.0,
) -> NftTerms:
    """Sums over the valid entries of one micro-batch (v [B, N, C]); divide by the mini-batch's
    entry count for the mean loss."""
    v_old, x0, x_t, t, optimality, mask = (
        targets.v_old,
        targets.x0,
        targets.x_t,
        targets.t,
        targets.optimality,
        targets.mask,
    )
    v, v_old, x0, x_t = _wide(v), _wide(v_old), _wide(x0), _wide(x_t)
    times = _wide(t).view(-1, 1, 1)
    v_pos, v_neg = implicit_velocities(v, v_old, beta)
    positive = adaptive_x0_loss(x_t - times * v_pos, x0)
    negative = adaptive_x0_loss(x_t - times * v_neg, x0)
    r = _wide(optimality)
    per_entry = scale * (r * positive + (1.0 - r) * negative) / beta
    valid = mask.to(per_entry.dtype)
    policy_loss_sum = (per_entry.detach() * valid).sum()
    if kl is not None and kl_beta > 0:
        per_entry = per_entry + kl_beta * kl
    deviation = ((v.detach() - v_old.detach()) ** 2).flatten(1).mean(dim=1)
    return NftTerms(
        loss_sum=(per_entry * valid).sum(),
        policy_loss_sum=policy_loss_sum,
        positive_sum=(positive.detach() * valid).sum(),
        negative_sum=(negative.detach() * valid).sum(),
        old_deviation_sum=(deviation * valid).sum(),
        count=valid.sum(),
    )


def velocity_kl(v: Tensor, v_ref: Tensor) -> Tensor:
    """Per-sample mean((v - v_ref)^2) [B]: the reference's KL term on velocities."""
    return ((_wide(v) - _wide(v_ref).detach()) ** 2).flatten(1).mean(dim=1)


def _wide(x: Tensor) -> Tensor:
    """fp32 at least (bf16 activations are widened; fp64 test inputs stay fp64)."""
    return x.to(torch.promote_types(x.dtype, torch.float32))
