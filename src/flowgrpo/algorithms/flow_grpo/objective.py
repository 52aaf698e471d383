"""FlowGRPO's objective on the trainer (docs/algorithms.md; the loop is ``TrainStep``'s).

1. ``begin``: logp_old, the proximal policy's log-prob of every stored window step, recomputed
   without gradients with the weights at the start of the step (or, with ``logp_old=bypass``, the
   behaviour log-probs the rollout stored, while the measured gap stays below eps / 10), and the
   truncated importance weights of the samples an older version sampled (async);
2. ``micro_batch``: every trained step recomputes the CFG-combined velocity with gradients and
   scores the stored x_{t+1} with ``window_step``: the functions the sampler used, so behaviour and
   training log-probs are the same function; the clipped surrogate (``loss.flow_grpo_terms``);
3. ``before_update`` of the first mini-batch: the weight-sync alarm (``loss.max_logp_gap``) on the
   samples of the trainer's own version, measured free on that forward, before any update.
"""

from __future__ import annotations

import contextlib
import math
import time
from collections.abc import Sequence

import torch
from torch import Tensor

from flowgrpo.algorithms.flow_grpo.loss import (
    LossTerms,
    effective_sample_size,
    flow_grpo_terms,
    importance_weights,
    kl_to_reference,
)
from flowgrpo.algorithms.objective import Forwards, Rows, Trajectory
from flowgrpo.configs.trainer import LossConfig
from flowgrpo.runtime.errors import ServiceError
from flowgrpo.sampler_math import StepResult
from flowgrpo.sampler_params import SamplerParams

ON_POLICY_GAP = "actor/on_policy_logp_gap/max"
ON_POLICY_ROWS = "actor/on_policy_logp_gap/rows"  # samples the alarm compared this step (0: it saw none)


class LogProbGapError(ServiceError):
    """The rollout's log-probs are not the trainer's for the same weights (the weight-sync alarm)."""


class FlowGRPOObjective:
    """The clipped policy gradient on the window's log-probs; ``last_gap`` (bypass) is state."""

    keeps_old_policy = False

    def __init__(self, forwards: Forwards, loss: LossConfig) -> None:
        self.forwards = forwards
        self.loss = loss
        self.metric_names = ("actor/pg_loss", "actor/pg_clipfrac", "actor/ratio_mean", "actor/ppo_kl") + (
            ("actor/kl_loss",) if loss.kl_beta > 0 else ()
        )
        self.last_gap = math.inf  # bypass: the rollout/trainer gap measured last time
        # the step being trained (set by begin)
        self._batch: Sequence[Trajectory] = ()
        self._params: SamplerParams | None = None
        self._version = 0
        self._logp_old = torch.zeros(0)
        self._weights = torch.zeros(0)
        self._behaviour = torch.zeros(0)
        self._lag = torch.zeros(0)
        self._gap = -1.0  # max on-policy gap of this rank's first mini-batch rows; -1: none
        self._gap_rows = 0

    # --- the step ---------------------------------------------------------------------------------

    def begin(
        self,
        batch: Sequence[Trajectory],
        params: SamplerParams,
        minis: list[list[int]],
        *,
        seed: int,
        step: int,
        version: int,
        steps_done: int,
    ) -> dict[str, float]:
        metrics: dict[str, float] = {}
        started = time.perf_counter()
        self._batch, self._params, self._version = batch, params, version
        self._behaviour = torch.stack([t.log_probs for t in batch])
        self._logp_old = self._logp_old_of(minis, steps_done, metrics)
        metrics["timing_s/old_log_prob"] = time.perf_counter() - started
        self._lag = torch.tensor([version - t.policy_version for t in batch], dtype=torch.float32)
        lag = self._lag[:, None].expand_as(self._behaviour)
        self._weights = importance_weights(self._logp_old, self._behaviour, lag, self.loss.is_cap)
        self._gap, self._gap_rows = -1.0, 0
        return metrics

    def entries_per_sample(self) -> int:
        return int(self._logp_old.shape[1])

    def micro_batch(self, rows: Rows, scale: float, sums: Tensor, *, first: bool) -> None:
        batch, params = self._batch, self._params
        assert params is not None  # begin ran
        part = [batch[r] for r, _ in rows]
        # the reference forward first: full training swaps the reference weights in place,
        # which must not happen while the policy forward's graph holds the parameters
        reference = self._reference_means(part, params) if self.loss.kl_beta > 0 else None
        result = self.forwards.window_log_probs(part, params)
        if first:
            self._measure_on_policy_gap(rows, result.log_prob)
        index = torch.tensor([r for r, _ in rows])
        kl = (
            kl_to_reference(result.mean.flatten(0, 1), reference, result.std.flatten())
            if reference is not None
            else None
        )
        window = self._logp_old.shape[1]
        device = result.log_prob.device
        terms = self._terms(
            rows,
            result,
            logp=result.log_prob.flatten(),
            logp_old=self._logp_old[index].flatten().to(device),
            advantages=torch.tensor([batch[r].advantage for r, _ in rows])
            .repeat_interleave(window)
            .to(device),
            mask=torch.tensor([valid for _, valid in rows]).repeat_interleave(window).to(device),
            weights=self._weights[index].flatten().to(device),
            kl=kl,
        )
        torch.autograd.backward(terms.loss_sum * scale)
        parts = [terms.pg_loss_sum, terms.clipped, terms.ratio_sum, terms.approx_kl_sum]
        if kl is not None:
            parts.append(kl.detach().sum())
        sums += torch.stack([p.double().cpu() for p in parts])

    def _terms(
        self,
        rows: Rows,
        result: StepResult,
        *,
        logp: Tensor,
        logp_old: Tensor,
        advantages: Tensor,
        mask: Tensor,
        weights: Tensor,
        kl: Tensor | None,
    ) -> LossTerms:
        return flow_grpo_terms(
            logp,
            logp_old,
            advantages,
            mask,
            clip_eps=self.loss.clip_eps,
            weights=weights,
            kl=kl,
            kl_beta=self.loss.kl_beta,
        )

    def before_update(self, first: bool) -> dict[str, float]:
        """The first mini-batch's on-policy gap over every rank (absent when no sample is on
        policy); above ``loss.max_logp_gap`` the step stops here, before any update."""
        if not first:
            return {}
        dist = self.forwards.dist
        rows = int(dist.sum(torch.tensor([self._gap_rows], dtype=torch.float64)))
        gap = float(dist.max(torch.tensor([self._gap], dtype=torch.float64)))
        if gap < 0:
            return {ON_POLICY_ROWS: 0.0}
        if gap > self.loss.max_logp_gap:
            raise LogProbGapError(
                f"the rollout's log-probs differ from the trainer's by up to {gap:.3g} on samples of the "
                f"trainer's own version {self._version} (trainer.loss.max_logp_gap="
                f"{self.loss.max_logp_gap:g}): the rollout is not sampling the published weights (a "
                "broken weight sync) or computes another function; nothing was updated. Check the "
                "rollouts' LoadWeights, or use trainer.loss.logp_old=recompute with a larger threshold"
            )
        return {ON_POLICY_GAP: gap, ON_POLICY_ROWS: float(rows)}

    def end(self, *, steps_done: int, optimizer_steps: int) -> dict[str, float]:
        """The effective sample size of the off-policy rows' importance weights (async)."""
        off_policy = self._lag > 0
        if not bool(off_policy.any()):
            return {}
        return {"actor/is_ess": float(effective_sample_size(self._weights[off_policy].flatten()))}

    def sampling_policy(self) -> contextlib.AbstractContextManager[None]:
        """FlowGRPO's rollouts sample with the trained policy itself."""
        return contextlib.nullcontext()

    def counters(self) -> dict[str, float]:
        return {"last_gap": self.last_gap}

    def restore(self, counters: dict[str, float]) -> None:
        self.last_gap = float(counters.get("last_gap", math.inf))  # inf: measure again first

    # --- logp_old -----------------------------------------------------------------------------------

    def recompute(self, batch: Sequence[Trajectory], params: SamplerParams) -> Tensor:
        """The window log-probs [B, W] of ``batch`` under the current weights, as the step's
        logp_old recompute computes them (micro-batches, no gradients; every rank gets all)."""
        self._batch, self._params = batch, params
        return self._recompute([list(range(len(batch)))])

    def _recompute_parts(self, minis: list[list[int]]) -> list[Rows]:
        """The micro-batches of this rank's recompute: the whole batch shared over the ranks."""
        return self.forwards.chunks(self.forwards.dist.share([r for mini in minis for r in mini]))

    def _recompute(self, minis: list[list[int]]) -> Tensor:
        batch, params = self._batch, self._params
        assert params is not None
        recomputed = torch.zeros(len(batch), batch[0].log_probs.shape[0])
        with torch.no_grad():
            for part in self._recompute_parts(minis):
                self.forwards.may_stop()
                result = self.forwards.window_log_probs([batch[r] for r, _ in part], params)
                for i, (row, valid) in enumerate(part):
                    if valid:
                        recomputed[row] = result.log_prob[i].to(recomputed.device)
                        self._keep(row, result, i)
        return self.forwards.dist.sum(recomputed)  # every rank holds the whole batch's logp_old

    def _keep(self, row: int, result: StepResult, i: int) -> None:
        """What else of the recompute the objective keeps (GRPO-Guard: the step means)."""

    def _logp_old_of(self, minis: list[list[int]], steps_done: int, metrics: dict[str, float]) -> Tensor:
        bypass = (
            self.loss.logp_old == "bypass"
            and steps_done % self.loss.bypass_check_every != 0
            and self.last_gap < self.loss.clip_eps / 10
        )
        if bypass:
            metrics["actor/logp_old_bypassed"] = 1.0
            return self._behaviour
        recomputed = self._recompute(minis)
        gap = (recomputed - self._behaviour).abs()
        self.last_gap = float(gap.max())
        metrics["actor/rollout_logp_gap/mean"] = float(gap.mean())
        metrics["actor/rollout_logp_gap/max"] = float(gap.max())
        metrics["actor/logp_old_bypassed"] = 0.0
        return recomputed

    # --- the alarm and the KL ----------------------------------------------------------------------

    def _measure_on_policy_gap(self, rows: Rows, log_prob: Tensor) -> None:
        """max |trainer log-prob - behaviour log-prob| over the rows the trainer's current version
        sampled (lag 0: the same weights on both sides). Rows of older versions (async) cannot be
        compared: their weights are gone; ``ON_POLICY_ROWS`` says how many rows were compared."""
        keep = [
            k
            for k, (row, valid) in enumerate(rows)
            if valid and self._batch[row].policy_version == self._version
        ]
        if not keep:
            return
        compared = [rows[k][0] for k in keep]
        gap = float(
            (log_prob.detach()[keep].to("cpu", torch.float32) - self._behaviour[compared]).abs().max()
        )
        self._gap = max(self._gap, gap)
        self._gap_rows += len(keep)

    def _reference_means(self, part: Sequence[Trajectory], params: SamplerParams) -> Tensor:
        """The reference policy's step means of the stored window steps, flattened [B*W, ...]."""
        with torch.no_grad(), self.forwards.policy.reference():
            return self.forwards.window_log_probs(part, params).mean.flatten(0, 1)
