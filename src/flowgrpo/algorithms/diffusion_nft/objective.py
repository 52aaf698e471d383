"""DiffusionNFT's objective on the trainer (docs/algorithms.md; the loop is ``TrainStep``'s).

DiffusionNFT trains on the forward process: for each sample's clean latent x0 (what any solver
produced; no log-prob, no SDE window) and a few times t of the sampling schedule, x_t = (1 - t) x0
+ t eps is noised again and the current velocity v is regressed, through the implicit positive and
negative policies built with the old (sampling) policy's v_old, onto x0, weighted by the sample's
optimality r in [0, 1] (the coordinator's target: ``flowgrpo.algorithms.diffusion_nft``). After
the step the old policy moves toward the current one: old <- d old + (1 - d) current, d a function
of the optimizer steps taken so far (``NftConfig.old_decay``, as the reference counts them).

The rollouts sample with the OLD policy: that is what the trainer publishes (``sampling_policy``).
There is no importance ratio: a sample from an older sampling policy (async, lag > 0) is still a
clean image with a reward, trained on as the paper's off-policy data; lag only says how stale the
positive/negative split is, and is reported.

Randomness (which times, which eps) is a pure function of (run seed, step, prompt uid, sample
index), like the rollout's: results never depend on the number of ranks or the batch split.
"""

from __future__ import annotations

import contextlib

import torch
from torch import Tensor

from flowgrpo.algorithms.diffusion_nft.loss import NftTargets, diffusion_nft_terms, velocity_kl
from flowgrpo.algorithms.objective import (
    Draw,
    ForwardProcessObjective,
    Forwards,
    Rows,
    Trajectory,
    draw_noises,
)
from flowgrpo.configs.trainer import LossConfig, NftConfig
from flowgrpo.devices import to_device
from flowgrpo.models.bagel.attention import KVCache
from flowgrpo.sampler_math import coordinate_seed, shifted_schedule
from flowgrpo.sampler_params import SamplerParams


class DiffusionNFTObjective(ForwardProcessObjective):
    """Keeps the old policy (``policy.keep_old``) and refreshes it after every step."""

    keeps_old_policy = True

    def __init__(self, forwards: Forwards, loss: LossConfig, nft: NftConfig) -> None:
        super().__init__(forwards, "DiffusionNFT")
        self.loss = loss
        self.nft = nft
        self.metric_names = (
            "actor/pg_loss",
            "actor/nft/positive_loss",
            "actor/nft/negative_loss",
            "actor/nft/old_deviation",
        ) + (("actor/kl_loss",) if loss.kl_beta > 0 else ())
        if not forwards.policy.model.vae2llm.weight.is_meta:
            forwards.policy.keep_old()

    def entries_per_sample(self) -> int:
        return int(self._draws[0][0].numel())

    def draw(self, sample: Trajectory, params: SamplerParams, seed: int, step: int) -> Draw:
        """The sample's trained times [K] (distinct points of the schedule before t = 0, a random
        subset as the reference's shuffled schedule) and its noises [K, N, C]."""
        schedule = shifted_schedule(params.num_points, params.timestep_shift)[:-1]
        count = self.nft.trained_times(len(schedule))
        key = (seed, step, sample.prompt_uid, sample.sample_index)
        generator = torch.Generator().manual_seed(coordinate_seed(*key, "nft/times"))
        times = schedule[torch.randperm(len(schedule), generator=generator)[:count]]
        return times, draw_noises(sample, count, seed=seed, step=step, stream="nft")

    def time_backward(
        self, rows: Rows, context: KVCache, k: int, params: SamplerParams, scale: float
    ) -> Tensor:
        forwards, batch = self.forwards, self._batch
        mask = torch.tensor([float(valid) for _, valid in rows])
        x0, t, _, x_t = self.noised(rows, k)
        with torch.no_grad(), forwards.policy.old():
            v_old = forwards.velocity(context, x_t, t, params)
        v_ref = None
        if self.loss.kl_beta > 0:
            with torch.no_grad(), forwards.policy.reference():
                v_ref = forwards.velocity(context, x_t, t, params)
        v = forwards.velocity(context, x_t, t, params)
        device = v.device
        optimality = torch.tensor([batch[r].advantage for r, _ in rows]).clamp(0.0, 1.0)  # as the reference
        targets = NftTargets(v_old, *(to_device(x, device) for x in (x0, x_t, t, optimality, mask)))
        kl = velocity_kl(v, v_ref) if v_ref is not None else None
        terms = diffusion_nft_terms(
            v, targets, beta=self.nft.beta, scale=self.nft.adv_clip, kl=kl, kl_beta=self.loss.kl_beta
        )
        torch.autograd.backward(terms.loss_sum * scale)
        parts = [terms.policy_loss_sum, terms.positive_sum, terms.negative_sum, terms.old_deviation_sum]
        if kl is not None:
            parts.append((kl.detach() * targets.mask).sum())
        return torch.stack([p.double() for p in parts])

    def end(self, *, steps_done: int, optimizer_steps: int) -> dict[str, float]:
        """The old policy one decay toward the current one (the decay after ``optimizer_steps``)."""
        decay = self.nft.old_decay(optimizer_steps)
        self.forwards.policy.refresh_old(decay)
        return {"actor/nft/old_decay": decay}

    def sampling_policy(self) -> contextlib.AbstractContextManager[None]:
        return self.forwards.policy.old()
