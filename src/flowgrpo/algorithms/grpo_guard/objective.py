"""GRPO-Guard's objective on the trainer: FlowGRPO's, with the ratio re-normalised by the drift of
each step's mean from the proximal policy's (``loss.grpo_guard_terms``; docs/algorithms.md).

The proximal means come from the logp_old recompute, so each rank recomputes exactly the rows it
trains (each mini-batch shared over the ranks as the update shares it) and keeps their means; the
first mini-batch's rows, whose logp_old is their own forward's, take that forward's means (drift 0,
ratio 1: the proximal policy is the current one).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import Tensor

from flowgrpo.algorithms.flow_grpo.loss import LossTerms
from flowgrpo.algorithms.flow_grpo.objective import FlowGRPOObjective
from flowgrpo.algorithms.grpo_guard.loss import GuardStep, grpo_guard_terms
from flowgrpo.algorithms.objective import Forwards, Rows, Trajectory
from flowgrpo.configs.trainer import LossConfig
from flowgrpo.devices import to_device
from flowgrpo.sampler_math import StepResult
from flowgrpo.sampler_params import SamplerParams


class GRPOGuardObjective(FlowGRPOObjective):
    def __init__(self, forwards: Forwards, loss: LossConfig) -> None:
        super().__init__(forwards, loss)
        self._mean_old: dict[int, Tensor] = {}  # row -> the proximal policy's step means [W, N, C]

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
        self._mean_old = {}
        return super().begin(
            batch, params, minis, seed=seed, step=step, version=version, steps_done=steps_done
        )

    def _recompute_parts(self, minis: list[list[int]]) -> list[Rows]:
        """Each mini-batch shared over the ranks as the update shares it: every rank holds the
        proximal means of the rows it trains."""
        share, chunks = self.forwards.dist.share, self.forwards.chunks
        return [part for mini in minis for part in chunks(share(mini))]

    def _keep(self, row: int, result: StepResult, i: int) -> None:
        self._mean_old[row] = result.mean[i].cpu()

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
        return grpo_guard_terms(
            logp,
            logp_old,
            advantages,
            mask,
            step=self._guard_step(rows, result),
            clip_eps=self.loss.clip_eps,
            weights=weights,
            kl=kl,
            kl_beta=self.loss.kl_beta,
        )

    def _guard_step(self, rows: Rows, result: StepResult) -> GuardStep:
        """Per (sample, window step): the drift of the mean from the proximal policy's, the step's
        std and -dt, flattened like the log-probs. A padding row takes its own mean as the proximal
        one (drift 0): it counts for nothing, and must stay finite (inf x mask 0 is NaN); so does a
        row of the first mini-batch, whose proximal policy is this forward's."""
        device = result.mean.device
        means = []
        for i, (row, valid) in enumerate(rows):
            if valid and not self._fresh[row]:
                means.append(to_device(self._mean_old[row], device))
            else:
                means.append(result.mean[i].detach())
        mean_old = torch.stack(means)
        drift = ((result.mean - mean_old) ** 2).flatten(2).mean(dim=2)  # [B, W]
        sigmas = to_device(torch.stack([self._batch[r].sigmas for r, _ in rows]), device)  # [B, W + 1]
        return GuardStep(drift.flatten(), result.std.flatten(), (sigmas[:, :-1] - sigmas[:, 1:]).flatten())
