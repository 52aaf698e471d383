"""One FlowGRPO training step over a batch of trajectories.

1. logp_old: the proximal policy's log-prob of every stored window step, recomputed without
   gradients with the weights at the start of the step (or, with ``bypass``, the behaviour
   log-probs the rollout stored, while the measured gap stays below eps / 10);
2. the batch is cut into ``mini_batches`` mini-batches, one optimizer step each; a mini-batch
   runs in micro-batches of ``micro_batch_size`` samples whose gradients accumulate;
3. every trained step recomputes the CFG-combined velocity with gradients through
   ``guided_velocity`` and scores the stored x_{t+1} with ``window_step``: the functions the
   sampler used, so behaviour and training log-probs are the same function.

The prompt cache depends only on the frozen und path: it is prefilled without gradients.

On a GPU with bf16 frozen weights, the forwards run under bf16 autocast (``compute_autocast``, which
the rollout's sampler enters too: both compute the same bf16 function):
the fp32 trainable tensors (LoRA A/B, or an unsharded fp32 gen path) are cast to bf16 for their
matmuls and receive fp32 gradients, as the frozen bf16 matmuls do. Without it peft runs every LoRA
matmul in fp32 (CUDA cores, ~1/15 of the bf16 rate) and a one-process fp32 gen path cannot meet
the bf16 und path at all. On the CPU (fp32 tests) nothing changes: autocast is never entered.
"""

from __future__ import annotations

import contextlib
import math
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch
from torch import Tensor

from flowgrpo.models.bagel.config import SpecialTokens
from flowgrpo.models.bagel.model import latent_position_ids
from flowgrpo.models.bagel.sampling import (
    compute_autocast,
    deterministic_kernels,
    guided_velocity,
    lora_inputs_uncast,
    prefill_prompts,
    token_grid,
    window_step,
    with_cfg_branches,
)
from flowgrpo.runtime.errors import ServiceError
from flowgrpo.sampler_math import StepResult, shifted_schedule
from flowgrpo.sampler_params import SamplerParams
from flowgrpo.services.trainer.config import LossConfig, OptimConfig
from flowgrpo.services.trainer.distributed import Dist, full_tensor
from flowgrpo.services.trainer.loss import (
    GuardStep,
    effective_sample_size,
    flow_grpo_terms,
    grpo_guard_terms,
    importance_weights,
    kl_to_reference,
)
from flowgrpo.services.trainer.policy import TrainablePolicy


@dataclass
class Trajectory:
    """One sample to train on, as the rollout stored it."""

    prompt_uid: str
    sample_index: int
    policy_version: int
    advantage: float
    prompt_ids: Tensor  # [L] int64
    latents: Tensor  # [W + 1, N, 64] fp32 (FlowGRPO's inputs: empty for DiffusionNFT)
    log_probs: Tensor  # [W] fp32: behaviour log-probs
    sigmas: Tensor  # [W + 1] fp32
    final_latents: Tensor | None = None  # [N, 64] fp32: the clean latent (DiffusionNFT's input)


ON_POLICY_GAP = "actor/on_policy_logp_gap/max"


class LogProbGapError(ServiceError):
    """The rollout's log-probs are not the trainer's for the same weights (the weight-sync alarm)."""


class FlowGRPOStep:
    """Owns the optimizer and the policy version; ``run`` trains on one batch."""

    def __init__(
        self,
        policy: TrainablePolicy,
        special: SpecialTokens,
        optim: OptimConfig,
        loss: LossConfig,
        dist: Dist | None = None,
    ) -> None:
        self.policy = policy
        self.dist = dist or Dist()
        self.special = special
        self.loss = loss
        self.optim_config = optim
        self.optimizer = adamw(policy, optim)
        self.version = 0  # weight publications so far
        self.steps_done = 0
        self.mixed_precision = True  # bf16 autocast on a GPU with bf16 frozen weights (compute_autocast)
        self.last_gap = math.inf  # bypass: the rollout/trainer gap measured last time
        self._may_stop: Callable[[], None] = stop_nothing  # the running step's stop check (see run)
        self._mean_old: dict[int, Tensor] = {}  # grpo_guard: row -> the proximal policy's step means

    # --- the step -----------------------------------------------------------------------------

    def run(
        self,
        batch: Sequence[Trajectory],
        params: SamplerParams,
        may_stop: Callable[[], None] | None = None,
        *,
        seed: int = 0,
        step: int = 0,
    ) -> dict[str, float]:
        """Train on ``batch``. ``may_stop`` is called between micro-batches until the first
        optimizer update (it raises to abandon the step): before it, nothing of the step has
        touched the weights or the optimizer, so an abandoned step leaves the trainer as it was;
        once an update is applied the step runs to its end. ``seed`` and ``step`` are the
        coordinates of whatever a step draws at random (FlowGRPO draws nothing)."""
        if not batch:
            raise ValueError("a training step needs at least one trajectory")
        self._may_stop = may_stop or stop_nothing
        try:
            with self._lora_inputs_uncast():
                return self._run(batch, params, seed, step)
        finally:
            self._may_stop = stop_nothing

    def sampling_policy(self) -> contextlib.AbstractContextManager[None]:
        """Inside, the policy is the one rollouts sample with (what is published): FlowGRPO's is
        the trained policy itself."""
        return contextlib.nullcontext()

    def _run(
        self, batch: Sequence[Trajectory], params: SamplerParams, seed: int, step: int
    ) -> dict[str, float]:
        metrics: dict[str, float] = {}
        started = time.perf_counter()
        behaviour = torch.stack([t.log_probs for t in batch])
        logp_old = self._logp_old(batch, params, behaviour, metrics)
        metrics["timing_s/old_log_prob"] = time.perf_counter() - started
        lag = torch.tensor([self.version - t.policy_version for t in batch], dtype=torch.float32)
        weights = importance_weights(logp_old, behaviour, lag[:, None].expand_as(behaviour), self.loss.is_cap)
        started = time.perf_counter()
        self._update(batch, params, logp_old, weights, metrics, behaviour=behaviour)
        metrics["timing_s/update_actor"] = time.perf_counter() - started
        self.version += 1
        self.steps_done += 1
        metrics.update(batch_metrics(batch, lag, weights))
        return metrics

    def _lora_inputs_uncast(self) -> contextlib.AbstractContextManager[None]:
        """peft's LoRA input casts off for the whole step, backward and recomputes included
        (``lora_inputs_uncast``: the rollout's sampler does the same)."""
        if not self.mixed_precision:
            return contextlib.nullcontext()
        return lora_inputs_uncast(self.policy.model)

    def recompute(self, batch: Sequence[Trajectory], params: SamplerParams) -> Tensor:
        """The window log-probs [B, W] of ``batch`` under the current weights, as the step's
        logp_old recompute computes them (micro-batches, no gradients; every rank gets all)."""
        with self._lora_inputs_uncast():
            return self._recompute(batch, params)

    def _recompute(self, batch: Sequence[Trajectory], params: SamplerParams) -> Tensor:
        recomputed = torch.zeros(len(batch), batch[0].log_probs.shape[0])
        self._mean_old = {}
        with torch.no_grad():
            for part in self._chunks(self.dist.share(list(range(len(batch))))):
                self._may_stop()
                result = self._window_log_probs([batch[r] for r, _ in part], params)
                for i, (row, valid) in enumerate(part):
                    if valid:
                        recomputed[row] = result.log_prob[i].to(recomputed.device)
                        if self.loss.mode == "grpo_guard":  # this rank's rows are the ones it trains
                            self._mean_old[row] = result.mean[i].cpu()
        return self.dist.sum(recomputed)  # every rank holds the whole batch's logp_old

    def _logp_old(
        self, batch: Sequence[Trajectory], params: SamplerParams, behaviour: Tensor, metrics: dict[str, float]
    ) -> Tensor:
        bypass = (
            self.loss.logp_old == "bypass"
            and self.steps_done % self.loss.bypass_check_every != 0
            and self.last_gap < self.loss.clip_eps / 10
        )
        if bypass:
            metrics["actor/logp_old_bypassed"] = 1.0
            return behaviour
        recomputed = self._recompute(batch, params)
        gap = (recomputed - behaviour).abs()
        self.last_gap = float(gap.max())
        metrics["actor/rollout_logp_gap/mean"] = float(gap.mean())
        metrics["actor/rollout_logp_gap/max"] = float(gap.max())
        metrics["actor/logp_old_bypassed"] = 0.0
        return recomputed

    def _update(
        self,
        batch: Sequence[Trajectory],
        params: SamplerParams,
        logp_old: Tensor,
        weights: Tensor,
        metrics: dict[str, float],
        *,
        behaviour: Tensor,
    ) -> None:
        rows = list(range(len(batch)))
        size = math.ceil(len(rows) / self.loss.mini_batches)
        totals: dict[str, float] = {}
        for start in range(0, len(rows), size):
            mini = rows[start : start + size]
            first = behaviour if start == 0 else None  # before any update: the policy that sampled
            for key, value in self._optimizer_step(
                batch, mini, params, logp_old, weights, behaviour=first
            ).items():
                totals[key] = totals.get(key, 0.0) + value
        if ON_POLICY_GAP in totals:
            metrics[ON_POLICY_GAP] = totals[ON_POLICY_GAP]
        n = math.ceil(len(rows) / size)
        for key in (
            "actor/pg_loss",
            "actor/grad_norm",
            "actor/pg_clipfrac",
            "actor/ratio_mean",
            "actor/ppo_kl",
        ):
            metrics[key] = totals[key] / n
        metrics["actor/skipped_steps"] = totals["actor/skipped_steps"]
        metrics["actor/lr"] = self.optimizer.param_groups[0]["lr"]
        if self.loss.kl_beta > 0:
            metrics["actor/kl_loss"] = totals["actor/kl_loss"] / n

    def _optimizer_step(
        self,
        batch: Sequence[Trajectory],
        mini: list[int],
        params: SamplerParams,
        logp_old: Tensor,
        weights: Tensor,
        *,
        behaviour: Tensor | None = None,
    ) -> dict[str, float]:
        """One optimizer step on the mini-batch ``mini``. ``behaviour`` (the first mini-batch):
        also measure the on-policy gap on its forward, and stop before the update when it is
        above ``loss.max_logp_gap`` (:meth:`_check_on_policy_gap`)."""
        self.optimizer.zero_grad(set_to_none=True)
        gap = -1.0  # none of this rank's rows is on-policy
        window = logp_old.shape[1]
        total = float(len(mini) * window)  # every (sample, window step) of the mini-batch counts once
        sums = torch.zeros(5, dtype=torch.float64)  # loss, clipped, ratio, ppo_kl, kl: summed over entries
        for part in self._chunks(self.dist.share(mini)):
            self._may_stop()
            rows = [r for r, _ in part]
            # the reference forward first: full training swaps the reference weights in place,
            # which must not happen while the policy forward's graph holds the parameters
            reference = (
                self._reference_means([batch[i] for i in rows], params) if self.loss.kl_beta > 0 else None
            )
            result = self._window_log_probs([batch[i] for i in rows], params)
            if behaviour is not None:
                gap = max(gap, self._on_policy_gap(batch, part, result.log_prob, behaviour))
            index = torch.tensor(rows)
            kl = None
            if reference is not None:
                kl = kl_to_reference(result.mean.flatten(0, 1), reference, result.std.flatten())
            device = result.log_prob.device
            entries = (
                result.log_prob.flatten(),
                logp_old[index].flatten().to(device),
                torch.tensor([batch[i].advantage for i in rows]).repeat_interleave(window).to(device),
                torch.tensor([valid for _, valid in part]).repeat_interleave(window).to(device),
            )
            weighting = {
                "clip_eps": self.loss.clip_eps,
                "weights": weights[index].flatten().to(device),
                "kl": kl,
                "kl_beta": self.loss.kl_beta,
            }
            if self.loss.mode == "grpo_guard":
                guard = self._guard_step([batch[i] for i in rows], rows, result)
                terms = grpo_guard_terms(*entries, step=guard, **weighting)  # type: ignore[arg-type]
            else:
                terms = flow_grpo_terms(*entries, **weighting)  # type: ignore[arg-type]
            # FSDP averages gradients over ranks: scale by world to get the mini-batch mean
            torch.autograd.backward(terms.loss_sum * (self.dist.world / total))
            kl_sum = kl.detach().sum() if kl is not None else torch.zeros(())
            parts = [terms.pg_loss_sum, terms.clipped, terms.ratio_sum, terms.approx_kl_sum, kl_sum]
            sums += torch.stack([p.double().cpu() for p in parts])
        checked = self._check_on_policy_gap(gap) if behaviour is not None else {}
        (loss, clipped, ratio, ppo_kl, kl_loss), grad_norm, skipped = self._finish_update(sums, total)
        return checked | {
            "actor/pg_loss": loss,
            "actor/grad_norm": grad_norm,
            "actor/pg_clipfrac": clipped,
            "actor/ratio_mean": ratio,
            "actor/ppo_kl": ppo_kl,
            "actor/kl_loss": kl_loss,
            "actor/skipped_steps": float(skipped),
        }

    def _on_policy_gap(
        self, batch: Sequence[Trajectory], part: list[tuple[int, bool]], log_prob: Tensor, behaviour: Tensor
    ) -> float:
        """max |trainer log-prob - behaviour log-prob| over the part's rows the trainer's current
        version sampled (lag 0: the same weights on both sides); -1 when there are none."""
        keep = [
            k for k, (row, valid) in enumerate(part) if valid and batch[row].policy_version == self.version
        ]
        if not keep:
            return -1.0
        rows = [part[k][0] for k in keep]
        return float((log_prob.detach()[keep].to("cpu", torch.float32) - behaviour[rows]).abs().max())

    def _check_on_policy_gap(self, gap: float) -> dict[str, float]:
        """The first mini-batch's on-policy gap over every rank (absent when no sample is on
        policy: async); above ``loss.max_logp_gap`` the step stops here, before any update."""
        gap = float(self.dist.max(torch.tensor([gap], dtype=torch.float64)))
        if gap < 0:
            return {}
        if gap > self.loss.max_logp_gap:
            self.optimizer.zero_grad(set_to_none=True)  # the step is dropped: its gradients too
            raise LogProbGapError(
                f"the rollout's log-probs differ from the trainer's by up to {gap:.3g} on samples of the "
                f"trainer's own version {self.version} (trainer.loss.max_logp_gap="
                f"{self.loss.max_logp_gap:g}): the rollout is not sampling the published weights (a "
                "broken weight sync) or computes another function; nothing was updated. Check the "
                "rollouts' LoadWeights, or use trainer.loss.logp_old=recompute with a larger threshold"
            )
        return {ON_POLICY_GAP: gap}

    def _guard_step(self, part: Sequence[Trajectory], rows: list[int], result: StepResult) -> GuardStep:
        """GRPO-Guard's per-(sample, window step) drift of the mean from the proximal policy's,
        the step's std and -dt, flattened like the log-probs."""
        device = result.mean.device
        mean_old = torch.stack([self._mean_old.get(r, torch.zeros_like(result.mean[0])) for r in rows]).to(
            device
        )
        drift = ((result.mean - mean_old) ** 2).flatten(2).mean(dim=2)  # [B, W]
        sigmas = torch.stack([t.sigmas for t in part]).to(device)  # [B, W + 1]
        return GuardStep(drift.flatten(), result.std.flatten(), (sigmas[:, :-1] - sigmas[:, 1:]).flatten())

    def _finish_update(self, sums: Tensor, total: float) -> tuple[list[float], float, bool]:
        """The mini-batch's summed metrics as means over every rank's entries, then the update:
        the last point where the step may still stop; from it on, the step finishes."""
        means = (self.dist.sum(sums) / total).tolist()
        self._may_stop()
        self._may_stop = stop_nothing
        grad_norm, skipped = self._apply_gradients()
        return means, grad_norm, skipped

    def _apply_gradients(self) -> tuple[float, bool]:
        return apply_gradients(self.policy, self.optimizer, self.optim_config.grad_clip)

    # --- forwards ------------------------------------------------------------------------------

    def _window_log_probs(self, part: Sequence[Trajectory], params: SamplerParams) -> StepResult:
        """Log-probs [B, W] of the stored window steps under the current weights (the velocity
        has gradients when grad mode is on). One forward per window step, like the sampler;
        in deterministic mode under the sampler's deterministic kernels."""
        with deterministic_or_not(params):
            return self._window_log_probs_now(part, params)

    def _window_log_probs_now(self, part: Sequence[Trajectory], params: SamplerParams) -> StepResult:
        model = self.policy.model
        autocast = compute_autocast(model) if self.mixed_precision else contextlib.nullcontext()
        with torch.no_grad(), autocast:
            context = with_cfg_branches(
                model,
                prefill_prompts(model, [t.prompt_ids for t in part], invariant=params.batch_invariant),
                params,
            )
        device = context.key_mask.device
        rows, cols = token_grid(params)
        pos_ids = latent_position_ids(rows, cols, model.config.max_latent_size, device)
        after_first = float(shifted_schedule(params.num_points, params.timestep_shift)[1])
        latents = torch.stack([t.latents for t in part]).to(device)
        sigmas = torch.stack([t.sigmas for t in part]).to(device)
        steps = []
        for k in range(latents.shape[1] - 1):
            x, x_next, sigma, sigma_next = latents[:, k], latents[:, k + 1], sigmas[:, k], sigmas[:, k + 1]
            with autocast:
                v = guided_velocity(model, context, x, sigma, pos_ids, params=params, special=self.special)
            steps.append(
                window_step(params, x, v, sigma, sigma_next, sigma_after_first=after_first, x_next=x_next)
            )
        return StepResult(
            x_next=torch.stack([s.x_next for s in steps], dim=1),
            mean=torch.stack([s.mean for s in steps], dim=1),
            std=torch.stack([s.std for s in steps], dim=1),
            log_prob=torch.stack([s.log_prob for s in steps], dim=1),
        )

    def _reference_means(self, part: Sequence[Trajectory], params: SamplerParams) -> Tensor:
        """The reference policy's step means of the stored window steps, flattened [B*W, ...]."""
        with torch.no_grad(), self.policy.reference():
            return self._window_log_probs(part, params).mean.flatten(0, 1)

    def _chunks(self, rows: list[tuple[int, bool]]) -> list[list[tuple[int, bool]]]:
        size = self.loss.micro_batch_size
        return [rows[i : i + size] for i in range(0, len(rows), size)]


def adamw(policy: TrainablePolicy, optim: OptimConfig) -> torch.optim.AdamW:
    """The optimizer of every training step (FlowGRPO, DiffusionNFT, sft) over the trained tensors."""
    return torch.optim.AdamW(
        list(policy.trainable().values()),
        lr=optim.lr,
        betas=optim.betas,
        eps=optim.eps,
        weight_decay=optim.weight_decay,
    )


def apply_gradients(
    policy: TrainablePolicy, optimizer: torch.optim.Optimizer, grad_clip: float
) -> tuple[float, bool]:
    """Clip the gradient norm and step; a non-finite norm skips the update (the caller counts it).
    Returns (norm, skipped)."""
    trainable = list(policy.trainable().values())
    norm = full_tensor(torch.nn.utils.clip_grad_norm_(trainable, grad_clip))
    if not torch.isfinite(norm):
        optimizer.zero_grad(set_to_none=True)
        return float(norm), True
    optimizer.step()
    return float(norm), False


def stop_nothing() -> None:
    """The stop check outside a step, and once a step's first update is applied."""


def deterministic_or_not(params: SamplerParams) -> contextlib.AbstractContextManager[None]:
    """The sampler's deterministic kernels when the settings ask for them (forwards only)."""
    return deterministic_kernels() if params.deterministic else contextlib.nullcontext()


def batch_metrics(batch: Sequence[Trajectory], lag: Tensor, weights: Tensor | None) -> dict[str, float]:
    """The batch's advantages (DiffusionNFT: optimalities), lag, size and, for off-policy rows
    with importance weights, their effective sample size."""
    advantages = torch.tensor([t.advantage for t in batch])
    metrics = {
        "critic/advantages/mean": float(advantages.mean()),
        "critic/advantages/max": float(advantages.max()),
        "critic/advantages/min": float(advantages.min()),
        "trainer/lag/mean": float(lag.mean()),
        "trainer/lag/max": float(lag.max()),
        "trainer/samples": float(len(batch)),
    }
    off_policy = lag > 0
    if weights is not None and bool(off_policy.any()):
        metrics["actor/is_ess"] = float(effective_sample_size(weights[off_policy].flatten()))
    return metrics
