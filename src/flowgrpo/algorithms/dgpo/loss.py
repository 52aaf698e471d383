"""DGPO's objective as small pure functions.

Luo et al., "Reinforcing Diffusion Models by Direct Group Preference Optimization" (2025); the
equations and the reference code's constants are in docs/algorithms.md. Per trained time, with
x_t = (1 - t) x0 + t eps re-noised from each sample's clean latent x0:

    e_i   = mean((v_theta(x_t) - (eps - x0))^2)          the denoising error of sample i
    s_g   = beta / G sum_{i in g} A_i (e_i - e_ref_i)    minus the group preference's margin
    L_g   = -log sigmoid(-s_g) = softplus(s_g)           per group g of G samples

dL_g / de_i = sigmoid(s_g) beta A_i / G: the group's sum couples its samples, so a sample's
gradient coefficient needs the whole group's errors (:func:`group_logits`, summed over ranks and
micro-batches), after which each sample back-propagates on its own (:func:`surrogate_sum`). The
coefficient drops the constant beta / G, as the reference does: sigmoid(s_g) A_i, set to 0 where
the ratio to the old policy's error is clipped (:func:`gradient_clipped`).
"""

from __future__ import annotations

import torch
from torch import Tensor


def denoising_error(v: Tensor, x0: Tensor, eps: Tensor) -> Tensor:
    """Per-sample mean((v - (eps - x0))^2) [B] (or [B] of any leading shape): how far the velocity
    is from the one that carries x_t to this x0 (BAGEL's flow: x_t = (1 - t) x0 + t eps)."""
    v, x0, eps = _wide(v), _wide(x0), _wide(eps)
    return ((v - (eps - x0)) ** 2).flatten(-2).mean(dim=-1)


def group_sums(advantages: Tensor, error: Tensor, ref_error: Tensor, group: Tensor, groups: int) -> Tensor:
    """sum_i A_i (e_i - e_ref_i) per group [groups, ...] in float64: the part of each group's logit
    that ranks and micro-batches add up. ``group`` [B] holds each sample's group index; the
    advantages [B] broadcast over any further dims of the errors (the trained times)."""
    gap = (error.double() - ref_error.double()) * _along(advantages.double(), error)
    return torch.zeros((groups, *gap.shape[1:]), dtype=torch.float64).index_add_(0, group.cpu(), gap.cpu())


def group_logits(sums: Tensor, sizes: Tensor, beta: float) -> Tensor:
    """s_g = beta sum_g / G_g [groups, ...]: G_g the group's sample count."""
    return beta * sums / _along(sizes.double(), sums)


def dgpo_loss(logits: Tensor) -> Tensor:
    """-log sigmoid(-s): the group preference's negative log-likelihood (softplus, stable)."""
    return torch.nn.functional.softplus(logits)


def gradient_clipped(advantages: Tensor, error: Tensor, old_error: Tensor, clip_range: float) -> Tensor:
    """Where a sample's gradient stops (bool, shaped like the errors): its ratio
    exp(e_old - e) left 1 + clip_range for a positive advantage, 1 - clip_range otherwise: the
    current policy already fits a good sample that much better than the old one (or a bad one
    worse), as PPO's clip stops a ratio."""
    ratio = torch.exp(old_error.double() - error.double())
    positive = _along(advantages, error) > 0
    return torch.where(positive, ratio > 1.0 + clip_range, ratio < 1.0 - clip_range)


def sample_coefficients(logits: Tensor, advantages: Tensor, clipped: Tensor) -> Tensor:
    """sigmoid(s_g) A_i per sample (its group's logit ``logits`` already picked per sample), 0 where
    clipped: dL_g / de_i without the constant beta / G (the reference's scale)."""
    coefficient = torch.sigmoid(logits.double()) * _along(advantages.double(), logits)
    return torch.where(clipped, torch.zeros_like(coefficient), coefficient)


def surrogate_sum(
    error: Tensor, coefficients: Tensor, mask: Tensor, kl: Tensor | None = None, kl_beta: float = 0.0
) -> Tensor:
    """sum over valid samples of c_i e_i (+ kl_beta KL_i) [scalar]: with the coefficients held fixed,
    its gradient is the DGPO loss's (up to beta / G), whatever the samples' split."""
    per_sample = coefficients.to(error.dtype).detach() * error
    if kl is not None and kl_beta > 0:
        per_sample = per_sample + kl_beta * kl
    return (per_sample * mask.to(per_sample.dtype)).sum()


def _along(values: Tensor, like: Tensor) -> Tensor:
    """``values`` [B] viewed to broadcast over ``like`` [B, ...]."""
    return values.to(like.device).view(-1, *([1] * (like.dim() - 1)))


def _wide(x: Tensor) -> Tensor:
    """fp32 at least (bf16 activations are widened; fp64 test inputs stay fp64)."""
    return x.to(torch.promote_types(x.dtype, torch.float32))
