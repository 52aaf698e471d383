"""Advantage Weighted Matching's objective on the trainer (docs/algorithms.md; the loop is
``TrainStep``'s).

AWM trains on the forward process as pretraining does: each sample's clean latent x0 (what any
solver produced; no log-prob, no SDE window) is noised again at a few times t of the sampling
schedule, x_t = (1 - t) x0 + t eps, and the current velocity is matched to eps - x0 with the
reference's t-weighted "ghuber" loss, weighted by the sample's advantage A in [-1, 1] (the
coordinator's target: ``flowgrpo.algorithms.awm``). Optional pulls: toward the reference policy
(``trainer.loss.kl_beta``) and toward an average of the past policies (``trainer.algorithm.ema_kl_beta``),
kept in the policy's old copy and moved after each step: ema <- d ema + (1 - d) current.

The rollouts sample with the trained policy itself, as the reference's on-policy recipes do. The
reference's PPO ratio is identically 1 there (its old log-probs are the current ones, detached, and
its clip range of 1 never binds), so its gradient is the advantage-weighted loss's, which is what is
computed here. A sample from an older policy (async, lag > 0) is used as it is, without a ratio;
lag is reported.

CFG: the velocity trained is the one the sampler computes (``Forwards.velocity``), the guided one
when sampling uses CFG (the reference's ``train.cfg=True``), the conditional one when it does not
(its recipes, CFG-free at both ends): the loss always fits the policy that made the samples, never
the conditional velocity to images that guidance made.

Randomness (which times, which eps) is a pure function of (run seed, step, prompt uid, sample
index), like the rollout's: results never depend on the number of ranks or the batch split.
"""

from __future__ import annotations

import contextlib

import torch
from torch import Tensor

from flowgrpo.algorithms.awm import time_strata
from flowgrpo.algorithms.awm.loss import AwmTargets, awm_terms, velocity_distance
from flowgrpo.algorithms.objective import (
    Draw,
    ForwardProcessObjective,
    Forwards,
    Rows,
    Trajectory,
    draw_noises,
)
from flowgrpo.configs.trainer import AwmConfig, LossConfig
from flowgrpo.devices import to_device
from flowgrpo.models.bagel.attention import KVCache
from flowgrpo.sampler_math import coordinate_seed, shifted_schedule
from flowgrpo.sampler_params import SamplerParams


class AWMObjective(ForwardProcessObjective):
    """Keeps the average of past policies (``policy.keep_old``) when its pull is on."""

    def __init__(self, forwards: Forwards, loss: LossConfig, awm: AwmConfig) -> None:
        super().__init__(forwards, "AWM")
        self.loss = loss
        self.awm = awm
        self.keeps_old_policy = awm.ema_kl_beta > 0
        self.metric_names = (
            ("actor/pg_loss", "actor/awm/matching_loss")
            + (("actor/kl_loss",) if loss.kl_beta > 0 else ())
            + (("actor/awm/ema_kl",) if self.keeps_old_policy else ())
        )
        if self.keeps_old_policy and not forwards.policy.model.vae2llm.weight.is_meta:
            forwards.policy.keep_old()

    def entries_per_sample(self) -> int:
        return self.awm.train_times

    def draw(self, sample: Trajectory, params: SamplerParams, seed: int, step: int) -> Draw:
        """The sample's trained times [K], one point of the schedule drawn uniformly in each
        stratum (``time_strata``), and its noises [K, N, C]."""
        schedule = shifted_schedule(params.num_points, params.timestep_shift)[:-1]
        strata = time_strata(len(schedule), self.awm)
        key = (seed, step, sample.prompt_uid, sample.sample_index)
        generator = torch.Generator().manual_seed(coordinate_seed(*key, "awm/times"))
        uniform = torch.rand(len(strata), generator=generator, dtype=torch.float64).tolist()
        index = [lo + int(u * (hi - lo)) for (lo, hi), u in zip(strata, uniform, strict=True)]
        return schedule[index], draw_noises(sample, len(strata), seed=seed, step=step, stream="awm")

    def time_backward(
        self, rows: Rows, context: KVCache, k: int, params: SamplerParams, scale: float
    ) -> Tensor:
        forwards, policy, batch = self.forwards, self.forwards.policy, self._batch
        x0, t, eps, x_t = self.noised(rows, k)
        v_ref = v_ema = None
        if self.loss.kl_beta > 0:
            with torch.no_grad(), policy.reference():
                v_ref = forwards.velocity(context, x_t, t, params)
        if self.keeps_old_policy:
            with torch.no_grad(), policy.old():
                v_ema = forwards.velocity(context, x_t, t, params)
        v = forwards.velocity(context, x_t, t, params)
        device = v.device
        weights = torch.tensor([batch[r].advantage for r, _ in rows]).clamp(-1.0, 1.0)  # as the reference
        mask = torch.tensor([float(valid) for _, valid in rows])
        targets = AwmTargets(*(to_device(x, device) for x in (x0, eps, t, weights, mask)))
        terms = awm_terms(
            v,
            targets,
            power=self.awm.loss_power,
            kl=velocity_distance(v, v_ref) if v_ref is not None else None,
            kl_beta=self.loss.kl_beta,
            ema_kl=velocity_distance(v, v_ema) if v_ema is not None else None,
            ema_kl_beta=self.awm.ema_kl_beta,
        )
        torch.autograd.backward(terms.loss_sum * scale)
        parts = [terms.policy_loss_sum, terms.matching_sum]
        parts += [terms.kl_sum] if v_ref is not None else []
        parts += [terms.ema_kl_sum] if v_ema is not None else []
        return torch.stack([p.double() for p in parts])

    def end(self, *, steps_done: int, optimizer_steps: int) -> dict[str, float]:
        """The average one decay toward the current policy (the decay after ``optimizer_steps``)."""
        if not self.keeps_old_policy:
            return {}
        decay = self.awm.ema_decay(optimizer_steps)
        self.forwards.policy.refresh_old(decay)
        return {"actor/awm/ema_decay": decay}

    def sampling_policy(self) -> contextlib.AbstractContextManager[None]:
        """The trained policy itself: the reference samples on-policy (its average only regularises)."""
        return contextlib.nullcontext()
