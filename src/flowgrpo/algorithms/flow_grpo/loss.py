"""FlowGRPO's objective as small pure functions (GRPO-Guard's builds on them).

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


def importance_weights(logp_prox: Tensor, logp_behaviour: Tensor, off_policy: Tensor, cap: float) -> Tensor:
    """Truncated w = min(exp(logp_prox - logp_behaviour), cap) where ``off_policy`` (bool: drawn
    by another policy, an older version or an FP8 rollout); 1 elsewhere."""
    w = torch.exp(logp_prox - logp_behaviour).clamp(max=cap)
    return torch.where(off_policy, w, torch.ones_like(w))


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
    return summed_terms(
        per_entry, clipped, ratio, logp - logp_old, mask, weights=weights, kl=kl, kl_beta=kl_beta
    )


def summed_terms(
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
