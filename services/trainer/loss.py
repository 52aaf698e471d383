"""The training objectives as small pure functions: FlowGRPO's, then DiffusionNFT's.

Per trained window step of a sample: ratio = exp(logp - logp_old) and the clipped surrogate
max(-A ratio, -A clip(ratio, 1 - eps, 1 + eps)). Off-policy samples (lag > 0, async) use the
decoupled form: logp_old is the proximal policy (the trainer's weights at the start of the
step) and the term is weighted by w = exp(logp_prox - logp_behaviour), truncated at a cap; at
lag 0, w = 1 exactly and this is the on-policy loss. Rows that are padding carry mask 0: they
never count, and no real row is duplicated to fill a batch.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor


@dataclass(frozen=True)
class LossTerms:
    loss_sum: Tensor  # sum over valid entries of w * surrogate (+ beta * KL), differentiable
    pg_loss_sum: Tensor  # the same without the KL term (verl's actor/pg_loss), detached
    count: Tensor  # valid entries
    clipped: Tensor  # valid entries where the clipped branch is the active one
    ratio_sum: Tensor
    approx_kl_sum: Tensor  # sum of logp_old - logp (verl's ppo_kl)


def clipped_surrogate(
    logp: Tensor, logp_old: Tensor, advantages: Tensor, clip_eps: float
) -> tuple[Tensor, Tensor]:
    """Per-entry loss max(-A r, -A clip(r)) and whether the clip is active; all [B]."""
    ratio = torch.exp(logp - logp_old)
    unclipped = -advantages * ratio
    clipped = -advantages * torch.clamp(ratio, 1.0 - clip_eps, 1.0 + clip_eps)
    return torch.maximum(unclipped, clipped), clipped > unclipped


def importance_weights(logp_prox: Tensor, logp_behaviour: Tensor, lag: Tensor, cap: float) -> Tensor:
    """Truncated w = min(exp(logp_prox - logp_behaviour), cap) for off-policy rows; 1 at lag 0."""
    w = torch.exp(logp_prox - logp_behaviour).clamp(max=cap)
    return torch.where(lag > 0, w, torch.ones_like(w))


def effective_sample_size(weights: Tensor) -> Tensor:
    """(sum w)^2 / (n sum w^2) in (0, 1]: 1 when all weights are equal (in float64, capped at 1:
    rounding would otherwise report 1 + 1e-7 for equal float32 weights)."""
    w = weights.double()
    return (w.sum() ** 2 / (w.numel() * (w**2).sum()).clamp(min=1e-12)).clamp(max=1.0)


def kl_to_reference(mean: Tensor, mean_ref: Tensor, std: Tensor) -> Tensor:
    """Per-sample mean((mean_theta - mean_ref)^2) / (2 std^2) of the step's Gaussians; [B]."""
    sq = ((mean - mean_ref) ** 2).flatten(1).mean(dim=1)
    return sq / (2.0 * std.clamp(min=1e-12) ** 2)


def flow_grpo_terms(
    logp: Tensor,
    logp_old: Tensor,
    advantages: Tensor,
    mask: Tensor,
    *,
    clip_eps: float,
    weights: Tensor | None = None,
    kl: Tensor | None = None,
    kl_beta: float = 0.0,
) -> LossTerms:
    """Sums over the valid entries of one micro-batch (all inputs [B]); divide by the mini-batch's
    total count to get the mean loss, so micro-batches of any size accumulate exactly."""
    per_entry, clipped = clipped_surrogate(logp, logp_old.detach(), advantages, clip_eps)
    ratio = torch.exp(logp.detach() - logp_old.detach())
    return _summed(per_entry, clipped, ratio, logp - logp_old, mask, weights=weights, kl=kl, kl_beta=kl_beta)


def _summed(
    per_entry: Tensor,
    clipped: Tensor,
    ratio: Tensor,
    log_ratio: Tensor,
    mask: Tensor,
    *,
    weights: Tensor | None,
    kl: Tensor | None,
    kl_beta: float,
) -> LossTerms:
    """The sums over valid entries both clipped objectives report: importance-weighted loss (+ KL),
    clipped entries, ratio and verl's ppo_kl (-log_ratio)."""
    if weights is not None:
        per_entry = per_entry * weights.detach()
    valid = mask.to(per_entry.dtype)
    pg_loss_sum = (per_entry.detach() * valid).sum()
    if kl is not None and kl_beta > 0:
        per_entry = per_entry + kl_beta * kl
    return LossTerms(
        loss_sum=(per_entry * valid).sum(),
        pg_loss_sum=pg_loss_sum,
        count=valid.sum(),
        clipped=(clipped.to(valid.dtype) * valid).sum(),
        ratio_sum=(ratio.detach() * valid).sum(),
        approx_kl_sum=(-log_ratio.detach() * valid).sum(),
    )


@dataclass(frozen=True)
class GuardStep:
    """What GRPO-Guard needs of each (sample, window step) besides the log-probs; all [B]."""

    drift: Tensor  # mean((mean_theta - mean_old)^2) over the latent: how far the step's mean moved
    std: Tensor  # std_t of the SDE step
    dt: Tensor  # sigma - sigma_next > 0 (the step's -dt)


def grpo_guard_terms(
    logp: Tensor,
    logp_old: Tensor,
    advantages: Tensor,
    mask: Tensor,
    *,
    step: GuardStep,
    clip_eps: float,
    weights: Tensor | None = None,
    kl: Tensor | None = None,
    kl_beta: float = 0.0,
) -> LossTerms:
    """GRPO-Guard (Wang et al., 2025; verl-omni's ``grpo_guard`` loss mode): FlowGRPO with the
    ratio re-normalised against over-optimisation. With the step's variance var = std^2 (-dt) and
    b = drift / (2 var):

        log ratio = (logp - logp_old + b) sqrt(var),    loss = max(-A ratio, -A clip(ratio)) / (-dt)

    b cancels the always-negative mean shift that a moved mean gives the log-ratio of one noise
    draw (so the ratio is no longer biased low), the sqrt(var) factor gives it the same spread at
    every step, and 1 / (-dt) evens the steps' gradients. Needs ``sde_type="sde"`` (a Gaussian
    step with this variance)."""
    var = step.std.detach() ** 2 * step.dt
    ratio = torch.exp((logp - logp_old.detach() + step.drift / (2.0 * var)) * torch.sqrt(var))
    unclipped = -advantages * ratio
    clipped_value = -advantages * torch.clamp(ratio, 1.0 - clip_eps, 1.0 + clip_eps)
    per_entry = torch.maximum(unclipped, clipped_value) / step.dt
    return _summed(per_entry, clipped_value > unclipped, ratio, logp - logp_old, mask, weights=weights, kl=kl,
                   kl_beta=kl_beta)  # fmt: skip


# --- DiffusionNFT ---------------------------------------------------------------------------------
#
# Zheng et al., "DiffusionNFT: Online Diffusion Reinforcement with Forward Process" (2025); the
# equations and the reference code's constants are in docs/algorithms.md. Per sample and trained
# time t: x_t = (1 - t) x0 + t eps; from the current velocity v and the old (sampling) policy's
# v_old, the implicit positive policy v+ = beta v + (1 - beta) v_old and the implicit negative
# v- = (1 + beta) v_old - beta v; each predicts x0 as x_t - t v; the loss regresses both onto the
# clean x0, weighted by the optimality r in [0, 1]: r ||x0(v+) - x0||^2 + (1 - r) ||x0(v-) - x0||^2,
# each squared error divided by its own (detached) mean absolute error (adaptive weighting),
# all divided by beta and scaled by ``scale`` (the reference multiplies by its advantage clip).


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
