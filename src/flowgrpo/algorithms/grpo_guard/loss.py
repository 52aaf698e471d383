"""GRPO-Guard's objective as a pure function (FlowGRPO's terms with a re-normalised ratio)."""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

from flowgrpo.algorithms.flow_grpo.loss import LossTerms, summed_terms


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
    return summed_terms(
        per_entry,
        clipped_value > unclipped,
        ratio,
        logp - logp_old,
        mask,
        weights=weights,
        kl=kl,
        kl_beta=kl_beta,
    )
