"""FlowGRPO's objective on the trainer (docs/algorithms.md; the loop is ``TrainStep``'s).

1. ``begin``: logp_old, the proximal policy's log-prob of every stored window step: the policy at
   the start of the step. The rows of the first mini-batch take it from their own forward in
   (2), detached: nothing has updated the weights before it, so that forward is the proximal
   policy's (as TRL's GRPO does on-policy; the recompute pass would compute the same function
   again). The later mini-batches' rows are recomputed here, without gradients. With
   ``logp_old=bypass`` every row takes the behaviour log-probs the rollout stored, while the
   measured gap stays below eps / 10. Then the truncated importance weights of the samples
   another policy drew: an older version (async) or an FP8 rollout (``rollout.precision=fp8``;
   TIS, as FlashRL corrects FP8 LLM rollouts);
2. ``micro_batch``: every trained step recomputes the CFG-combined velocity with gradients and
   scores the stored x_{t+1} with ``window_step``: the functions the sampler used, so behaviour and
   training log-probs are the same function; the clipped surrogate (``loss.flow_grpo_terms``);
3. ``before_update`` of the first mini-batch: the first mini-batch's logp_old gathered from the
   ranks, so the gaps between logp_old and the behaviour log-probs are measured over every row
   (``actor/rollout_logp_gap/...``, ``actor/fp8_logp_gap/...``); the weight-sync alarm
   (``loss.max_logp_gap``; on FP8 samples ``loss.max_fp8_logp_gap``) on the samples of the
   trainer's own version, measured free on that forward, before any update.
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
from flowgrpo.devices import to_device
from flowgrpo.runtime.errors import ServiceError
from flowgrpo.sampler_math import StepResult
from flowgrpo.sampler_params import SamplerParams

ON_POLICY_GAP = "actor/on_policy_logp_gap/max"
ON_POLICY_ROWS = "actor/on_policy_logp_gap/rows"  # samples the alarm compared this step (0: it saw none)
ON_POLICY_FP8_GAP = "actor/on_policy_fp8_logp_gap/max"  # the same on the samples an FP8 rollout drew
ON_POLICY_FP8_ROWS = "actor/on_policy_fp8_logp_gap/rows"
GAP_QUANTILES = (0.5, 0.9, 0.99)


def gap_distribution(prefix: str, gap: Tensor) -> dict[str, float]:
    """Mean, quantiles (``GAP_QUANTILES``) and max of a flat tensor of log-prob gaps."""
    gap = gap.double()
    quantiles = torch.quantile(gap, torch.tensor(GAP_QUANTILES, dtype=torch.float64))
    return {
        f"{prefix}/mean": float(gap.mean()),
        **{f"{prefix}/p{round(q * 100)}": float(v) for q, v in zip(GAP_QUANTILES, quantiles, strict=True)},
        f"{prefix}/max": float(gap.max()),
    }


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
        self._off_policy = torch.zeros(0, dtype=torch.bool)  # [B]: drawn by another policy
        self._fp8 = torch.zeros(0, dtype=torch.bool)  # [B]: drawn by an FP8 rollout
        # [B]: logp_old from the row's first-mini-batch forward; those values land in
        # _fresh_logp ([B, W], on the forwards' device, this rank's rows) until before_update
        self._fresh = torch.zeros(0, dtype=torch.bool)
        self._fresh_logp = torch.zeros(0)
        # max on-policy gap of this rank's first mini-batch rows, [rollout in the trainer's
        # precision, FP8 rollout]; -1: none. On the forwards' device, read once before the
        # update: a read each micro-batch would make the host wait for its forward
        self._gap, self._gap_rows = torch.full((2,), -1.0, dtype=torch.float64), [0, 0]

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
        self._fp8 = torch.tensor([t.fp8 for t in batch], dtype=torch.bool)
        self._logp_old, self._fresh = self._logp_old_of(minis, steps_done, metrics)
        metrics["timing_s/old_log_prob"] = time.perf_counter() - started
        lag = torch.tensor([version - t.policy_version for t in batch])
        self._off_policy = (lag > 0) | self._fp8
        # the first mini-batch's rows: placeholders until _complete_logp_old (their micro-batches
        # weigh with their own forward's)
        self._weights = self._importance_weights(self._logp_old, torch.arange(len(batch)))
        self._fresh_logp = torch.zeros(self._behaviour.shape, device=self.forwards.device)
        self._gap = torch.full((2,), -1.0, dtype=torch.float64, device=self.forwards.device)
        self._gap_rows = [0, 0]
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
        if bool(self._fresh[index].any()):  # the first mini-batch: this forward is the proximal policy's
            logp_old = result.log_prob.detach()
            self._keep_fresh(rows, logp_old)
            weights = self._importance_weights(logp_old, index)
        else:
            logp_old = to_device(self._logp_old[index], device)
            weights = to_device(self._weights[index], device)
        terms = self._terms(
            rows,
            result,
            logp=result.log_prob.flatten(),
            logp_old=logp_old.flatten(),
            advantages=to_device(
                torch.tensor([batch[r].advantage for r, _ in rows]).repeat_interleave(window), device
            ),
            mask=to_device(torch.tensor([valid for _, valid in rows]).repeat_interleave(window), device),
            weights=weights.flatten(),
            kl=kl,
        )
        torch.autograd.backward(terms.loss_sum * scale)
        parts = [terms.pg_loss_sum, terms.clipped, terms.ratio_sum, terms.approx_kl_sum]
        if kl is not None:
            parts.append(kl.detach().sum())
        sums += torch.stack([p.double() for p in parts])  # on the device: no wait for the backward

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
        """The first mini-batch's on-policy gaps over every rank, of the samples drawn in the
        trainer's precision and of those an FP8 rollout drew (each absent when there were none);
        above ``loss.max_logp_gap`` (FP8: ``loss.max_fp8_logp_gap``) the step stops here, before
        any update."""
        if not first:
            return {}
        dist = self.forwards.dist
        metrics = self._complete_logp_old()
        rows = dist.sum(torch.tensor(self._gap_rows, dtype=torch.float64))
        gaps = dist.max(self._gap).tolist()
        metrics[ON_POLICY_ROWS] = float(rows[0])
        if int(rows[1]):
            metrics[ON_POLICY_FP8_ROWS] = float(rows[1])
        checks = (
            (float(gaps[0]), ON_POLICY_GAP, "max_logp_gap", self.loss.max_logp_gap),
            (float(gaps[1]), ON_POLICY_FP8_GAP, "max_fp8_logp_gap", self.loss.max_fp8_logp_gap),
        )
        for gap, name, key, threshold in checks:
            if gap < 0:
                continue
            if gap > threshold:
                raise LogProbGapError(
                    f"the rollout's log-probs differ from the trainer's by up to {gap:.3g} on "
                    f"{'FP8 ' if key == 'max_fp8_logp_gap' else ''}samples of the trainer's own version "
                    f"{self._version} (trainer.loss.{key}={threshold:g}): the rollout is not sampling the "
                    "published weights (a broken weight sync) or computes another function; nothing was "
                    "updated. Check the rollouts' LoadWeights, or use trainer.loss.logp_old=recompute "
                    "with a larger threshold"
                )
            metrics[name] = gap
        return metrics

    def end(self, *, steps_done: int, optimizer_steps: int) -> dict[str, float]:
        """The importance weights of the rows another policy drew (async, FP8): their effective
        sample size, range and the share the cap truncated."""
        if not bool(self._off_policy.any()):
            return {}
        weights = self._weights[self._off_policy].flatten()
        ratios = torch.exp(self._logp_old - self._behaviour)[self._off_policy].flatten()
        return {
            "actor/is_ess": float(effective_sample_size(weights)),
            "actor/is_weight/min": float(weights.min()),
            "actor/is_weight/mean": float(weights.mean()),
            "actor/is_weight/max": float(weights.max()),
            "actor/is_capped": float((ratios > self.loss.is_cap).double().mean()),
        }

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
        if not any(minis):  # one mini-batch: its forwards give every row's logp_old
            return recomputed
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

    def _logp_old_of(
        self, minis: list[list[int]], steps_done: int, metrics: dict[str, float]
    ) -> tuple[Tensor, Tensor]:
        """logp_old [B, W] (the first mini-batch's rows 0 until their forward fills them in) and
        which rows their forward fills [B]."""
        bypass = (
            self.loss.logp_old == "bypass"
            and steps_done % self.loss.bypass_check_every != 0
            and self.last_gap < self.loss.clip_eps / 10
        )
        fresh = torch.zeros(len(self._batch), dtype=torch.bool)
        metrics["actor/logp_old_bypassed"] = float(bypass)
        if bypass:
            return self._behaviour, fresh
        fresh[minis[0]] = True
        return self._recompute(minis[1:]), fresh

    def _keep_fresh(self, rows: Rows, logp_old: Tensor) -> None:
        """This rank's first-mini-batch rows' logp_old (from their forward), on the device."""
        valid = [k for k, (_, ok) in enumerate(rows) if ok]
        if valid:
            device = logp_old.device
            at = to_device(torch.tensor([rows[k][0] for k in valid]), device)
            self._fresh_logp[at] = logp_old.index_select(0, to_device(torch.tensor(valid), device)).float()

    def _complete_logp_old(self) -> dict[str, float]:
        """After the first mini-batch's forwards: its rows' logp_old from every rank (each row was
        trained on one), the importance weights of every row, and the gaps between logp_old and
        the behaviour log-probs over the step (none when logp_old was bypassed)."""
        if not bool(self._fresh.any()):
            return {}
        fresh = self.forwards.dist.sum(self._fresh_logp).cpu()  # one read, before the update
        self._logp_old[self._fresh] = fresh[self._fresh].to(self._logp_old.dtype)
        self._weights = self._importance_weights(self._logp_old, torch.arange(len(self._batch)))
        gap = (self._logp_old - self._behaviour).abs()
        self.last_gap = float(gap.max())
        metrics = {
            "actor/rollout_logp_gap/mean": float(gap.mean()),
            "actor/rollout_logp_gap/max": self.last_gap,
        }
        if bool(self._fp8.any()):  # what the quantization costs: |logp_old - logp_fp8| per window step
            metrics.update(gap_distribution("actor/fp8_logp_gap", gap[self._fp8].flatten()))
        return metrics

    def _importance_weights(self, logp_old: Tensor, rows: Tensor) -> Tensor:
        """The truncated importance weights [len(rows), W] of ``rows`` given their logp_old, on
        logp_old's device."""
        device = logp_old.device
        behaviour = to_device(self._behaviour[rows], device)
        off_policy = to_device(self._off_policy[rows], device)[:, None].expand_as(behaviour)
        return importance_weights(logp_old, behaviour, off_policy, self.loss.is_cap)

    # --- the alarm and the KL ----------------------------------------------------------------------

    def _measure_on_policy_gap(self, rows: Rows, log_prob: Tensor) -> None:
        """max |trainer log-prob - behaviour log-prob| over the rows the trainer's current version
        sampled (lag 0: the same weights on both sides), kept apart for the rows an FP8 rollout
        drew. Rows of older versions (async) cannot be compared: their weights are gone;
        ``ON_POLICY_ROWS`` says how many rows were compared."""
        for kind, fp8 in enumerate((False, True)):
            keep = [
                k
                for k, (row, valid) in enumerate(rows)
                if valid and self._batch[row].policy_version == self._version and self._batch[row].fp8 == fp8
            ]
            if not keep:
                continue
            compared = [rows[k][0] for k in keep]
            device = log_prob.device
            ours = log_prob.detach().index_select(0, to_device(torch.tensor(keep), device)).float()
            gap = (ours - to_device(self._behaviour[compared], device)).abs().max()
            self._gap[kind] = torch.maximum(self._gap[kind], gap.double())
            self._gap_rows[kind] += len(keep)

    def _reference_means(self, part: Sequence[Trajectory], params: SamplerParams) -> Tensor:
        """The reference policy's step means of the stored window steps, flattened [B*W, ...]."""
        with torch.no_grad(), self.forwards.policy.reference():
            return self.forwards.window_log_probs(part, params).mean.flatten(0, 1)
