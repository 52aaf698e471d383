"""One DiffusionNFT training step (``trainer.algorithm=diffusion_nft``; docs/algorithms.md).

DiffusionNFT trains on the forward process: for each sample's clean latent x0 (what any solver
produced; no log-prob, no SDE window) and a few times t of the sampling schedule, x_t = (1 - t) x0
+ t eps is noised again and the current velocity v is regressed, through the implicit positive and
negative policies built with the old (sampling) policy's v_old, onto x0, weighted by the sample's
optimality r in [0, 1] (the coordinator maps group advantages to it). After the step the old
policy moves toward the current one: old <- d old + (1 - d) current (``NftConfig.old_decay``).

The rollouts sample with the OLD policy: that is what this step publishes (``sampling_policy``).
There is no importance ratio: a sample from an older sampling policy (async, lag > 0) is still a
clean image with a reward, trained on as the paper's off-policy data; lag only says how stale the
positive/negative split is, and is reported.

Randomness (which times, which eps) is a pure function of (run seed, step, prompt uid, sample
index), like the rollout's: results never depend on the number of ranks or the batch split.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Sequence

import torch
from torch import Tensor

from flowgrpo.models.bagel.attention import KVCache
from flowgrpo.models.bagel.config import SpecialTokens, is_text_path
from flowgrpo.models.bagel.model import latent_position_ids
from flowgrpo.models.bagel.sampling import (
    compute_autocast,
    guided_velocity,
    prefill_prompts,
    token_grid,
    with_cfg_branches,
)
from flowgrpo.sampler_math import coordinate_seed, sample_noise, shifted_schedule
from flowgrpo.sampler_params import SamplerParams
from flowgrpo.services.trainer.config import LossConfig, NftConfig, OptimConfig
from flowgrpo.services.trainer.distributed import Dist
from flowgrpo.services.trainer.loss import NftTargets, diffusion_nft_terms, velocity_kl
from flowgrpo.services.trainer.policy import TrainablePolicy
from flowgrpo.services.trainer.step import (
    FlowGRPOStep,
    Trajectory,
    batch_metrics,
    deterministic_or_not,
)

METRICS = (
    "actor/pg_loss",
    "actor/grad_norm",
    "actor/nft/positive_loss",
    "actor/nft/negative_loss",
    "actor/nft/old_deviation",
)


class DiffusionNFTStep(FlowGRPOStep):
    """FlowGRPOStep's optimizer, versions and gradient handling, with the NFT objective; keeps the
    old policy (``policy.keep_old``) and refreshes it after every step."""

    def __init__(
        self,
        policy: TrainablePolicy,
        special: SpecialTokens,
        optim: OptimConfig,
        loss: LossConfig,
        *,
        nft: NftConfig,
        dist: Dist | None = None,
    ) -> None:
        super().__init__(policy, special, optim, loss, dist)
        self.nft = nft
        text = [n for n in policy.trainable() if is_text_path(n)]
        if text:  # the old, reference and current policies share one prefill (_context)
            raise ValueError(f"DiffusionNFT trains the gen path; {text[0]} (the language half) is trainable")
        if not policy.model.vae2llm.weight.is_meta:
            policy.keep_old()

    def sampling_policy(self) -> contextlib.AbstractContextManager[None]:
        return self.policy.old()

    def _run(
        self, batch: Sequence[Trajectory], params: SamplerParams, seed: int, step: int
    ) -> dict[str, float]:
        metrics: dict[str, float] = {}
        started = time.perf_counter()
        draws = [self._draw(t, params, seed, step) for t in batch]
        rows = list(range(len(batch)))
        size = -(-len(rows) // self.loss.mini_batches)
        totals: dict[str, float] = {}
        for start in range(0, len(rows), size):
            for key, value in self._nft_optimizer_step(
                batch, draws, rows[start : start + size], params
            ).items():
                totals[key] = totals.get(key, 0.0) + value
        steps = -(-len(rows) // size)
        metrics.update({key: totals[key] / steps for key in METRICS})
        metrics["actor/skipped_steps"] = totals["actor/skipped_steps"]
        metrics["actor/lr"] = self.optimizer.param_groups[0]["lr"]
        if self.loss.kl_beta > 0:
            metrics["actor/kl_loss"] = totals["actor/kl_loss"] / steps
        metrics["timing_s/update_actor"] = time.perf_counter() - started
        self.version += 1
        self.steps_done += 1
        decay = self.nft.old_decay(self.steps_done)
        self.policy.refresh_old(decay)
        metrics["actor/nft/old_decay"] = decay
        lag = torch.tensor([self.version - 1 - t.policy_version for t in batch], dtype=torch.float32)
        metrics.update(batch_metrics(batch, lag, None))  # no importance weights
        return metrics

    def _draw(self, sample: Trajectory, params: SamplerParams, seed: int, step: int) -> tuple[Tensor, Tensor]:
        """The sample's trained times [K] (distinct points of the schedule before t = 0, a random
        subset as the reference's shuffled schedule) and its noises [K, N, C]."""
        assert sample.final_latents is not None  # the core fetched them
        schedule = shifted_schedule(params.num_points, params.timestep_shift)[:-1]
        count = self.nft.trained_times(len(schedule))
        key = (seed, step, sample.prompt_uid, sample.sample_index)
        generator = torch.Generator().manual_seed(coordinate_seed(*key, "nft/times"))
        times = schedule[torch.randperm(len(schedule), generator=generator)[:count]]
        shape = tuple(sample.final_latents.shape)
        noises = torch.stack(
            [
                sample_noise(
                    shape,
                    seed=seed,
                    step=step,
                    prompt_uid=sample.prompt_uid,
                    sample_index=sample.sample_index,
                    stream=f"nft/{k}",
                )
                for k in range(count)
            ]
        )
        return times, noises

    def _nft_optimizer_step(
        self,
        batch: Sequence[Trajectory],
        draws: list[tuple[Tensor, Tensor]],
        mini: list[int],
        params: SamplerParams,
    ) -> dict[str, float]:
        self.optimizer.zero_grad(set_to_none=True)
        times_per_sample = draws[0][0].numel()
        total = float(len(mini) * times_per_sample)  # every (sample, time) of the mini-batch counts once
        sums = torch.zeros(5, dtype=torch.float64)  # policy loss, positive, negative, deviation, kl
        for part in self._chunks(self.dist.share(mini)):
            self._may_stop()
            # the prompts' context once for all the part's times and both policies: the prefill
            # reads only the language half, which no policy here trains (checked at __init__)
            context = self._context([batch[r] for r, _ in part], params)
            for k in range(times_per_sample):
                sums += self._nft_backward(batch, draws, part, context, k=k, params=params, total=total)
        (loss, positive, negative, deviation, kl), grad_norm, skipped = self._finish_update(sums, total)
        return {
            "actor/pg_loss": loss,
            "actor/grad_norm": grad_norm,
            "actor/nft/positive_loss": positive,
            "actor/nft/negative_loss": negative,
            "actor/nft/old_deviation": deviation,
            "actor/kl_loss": kl,
            "actor/skipped_steps": float(skipped),
        }

    def _nft_backward(
        self,
        batch: Sequence[Trajectory],
        draws: list[tuple[Tensor, Tensor]],
        micro: list[tuple[int, bool]],
        context: KVCache,
        *,
        k: int,
        params: SamplerParams,
        total: float,
    ) -> Tensor:
        """Forward and backward of the micro-batch (rows, valid) at each row's k-th time; the
        detached sums of the loss terms."""
        rows = [r for r, _ in micro]
        mask = torch.tensor([float(valid) for _, valid in micro])
        part = [batch[r] for r in rows]
        x0 = torch.stack([t.final_latents for t in part])  # type: ignore[misc]
        t = torch.stack([draws[r][0][k] for r in rows])
        eps = torch.stack([draws[r][1][k] for r in rows])
        x_t = (1.0 - t.view(-1, 1, 1)) * x0 + t.view(-1, 1, 1) * eps
        with torch.no_grad(), self.policy.old():
            v_old = self._velocity(context, x_t, t, params)
        v_ref = None
        if self.loss.kl_beta > 0:
            with torch.no_grad(), self.policy.reference():
                v_ref = self._velocity(context, x_t, t, params)
        v = self._velocity(context, x_t, t, params)
        device = v.device
        targets = NftTargets(
            v_old,
            x0.to(device),
            x_t.to(device),
            t.to(device),
            torch.tensor([batch[r].advantage for r in rows]).to(device),
            mask.to(device),
        )
        kl = velocity_kl(v, v_ref) if v_ref is not None else None
        terms = diffusion_nft_terms(
            v, targets, beta=self.nft.beta, scale=self.nft.adv_clip, kl=kl, kl_beta=self.loss.kl_beta
        )
        # FSDP averages gradients over ranks: scale by world to get the mini-batch mean
        torch.autograd.backward(terms.loss_sum * (self.dist.world / total))
        kl_sum = (kl.detach() * mask.to(device)).sum() if kl is not None else torch.zeros(())
        parts = [
            terms.policy_loss_sum,
            terms.positive_sum,
            terms.negative_sum,
            terms.old_deviation_sum,
            kl_sum,
        ]
        return torch.stack([p.double().cpu() for p in parts])

    def _context(self, part: Sequence[Trajectory], params: SamplerParams) -> KVCache:
        """The rows' prompts prefilled, with the CFG branch's rows when the settings ask for it,
        as the sampler builds them."""
        with deterministic_or_not(params), torch.no_grad():
            model = self.policy.model
            autocast = compute_autocast(model) if self.mixed_precision else contextlib.nullcontext()
            with autocast:
                prompts = prefill_prompts(
                    model, [s.prompt_ids for s in part], invariant=params.batch_invariant
                )
                return with_cfg_branches(model, prompts, params)

    def _velocity(self, context: KVCache, x_t: Tensor, t: Tensor, params: SamplerParams) -> Tensor:
        """The policy's velocity [B, N, C] at (x_t, t) for the context's prompts, as the sampler
        computes it (``guided_velocity``: CFG when the settings ask for it)."""
        with deterministic_or_not(params):
            model = self.policy.model
            autocast = compute_autocast(model) if self.mixed_precision else contextlib.nullcontext()
            device = context.key_mask.device
            rows, cols = token_grid(params)
            pos_ids = latent_position_ids(rows, cols, model.config.max_latent_size, device)
            with autocast:
                return guided_velocity(
                    model, context, x_t.to(device), t.to(device), pos_ids, params=params, special=self.special
                )
