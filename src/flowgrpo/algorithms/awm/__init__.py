"""Advantage Weighted Matching (Xue et al., 2025): the pretraining flow-matching loss on the
clean latents of any sampler, each sample's loss weighted by its advantage (docs/algorithms.md).
The coordinator's targets are the weights A = clip(A, -c, c) / c in [-1, 1]
(``trainer.algorithm.adv_clip`` = c); the trainer's objective is :mod:`flowgrpo.algorithms.awm.objective`."""

from __future__ import annotations

import itertools
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

import numpy as np

from flowgrpo.algorithms.awm.config import AwmConfig
from flowgrpo.algorithms.flow_grpo import check_no_window_knobs
from flowgrpo.algorithms.spec import Targets

if TYPE_CHECKING:
    from flowgrpo.configs.trainer import TrainerConfig
    from flowgrpo.sampler_params import SamplerSettings


def advantage_weights(advantages: Sequence[float], clip: float) -> list[float]:
    """AWM's weight per sample: A clipped to [-clip, clip], divided by clip (the reference's
    ``advantage_max`` of 1 in every recipe)."""
    a = np.clip(np.asarray(advantages, dtype=np.float64), -clip, clip) / clip
    return [float(x) for x in np.clip(a, -1.0, 1.0)]  # against rounding: the trainer clamps alike


def time_strata(num_steps: int, awm: AwmConfig) -> list[tuple[int, int]]:
    """The [lower, upper) ranges of schedule indices, one trained time drawn in each: ``train_times``
    equal strata of [first, int(num_steps x timestep_fraction)), their ends rounded down as the
    reference rounds them; a stratum narrower than one index gives its lower end (upper = lower)."""
    first = 0 if awm.from_first_point else 1
    end = int(num_steps * awm.timestep_fraction)
    if end <= first:
        raise ValueError(
            f"trainer.algorithm (awm) trains the schedule's points [{first}, int({num_steps} x "
            f"{awm.timestep_fraction}) = {end}) of a {num_steps}-step schedule: none; raise "
            "sampling.num_points or trainer.algorithm.timestep_fraction"
        )
    count, span = awm.train_times, end - first
    bounds = [first + k * span // count for k in range(count + 1)]  # floor(linspace), in exact integers
    return list(itertools.pairwise(bounds))


@dataclass(frozen=True)
class AdvantageWeightedMatching:
    name: str = "awm"
    columns: tuple[str, ...] = ("prompt_ids", "final_latents")  # the clean latent: no window, no log-prob

    def targets(self, advantages: Mapping[str, Sequence[float]], trainer: TrainerConfig) -> Targets:
        return {
            uid: advantage_weights(values, trainer.section(AwmConfig).adv_clip)
            for uid, values in advantages.items()
        }

    def check(self, trainer: TrainerConfig, sampling: SamplerSettings | None) -> None:
        """No window knobs; a schedule with at least one trainable time. Any sampler fits: the
        loss reads only the clean latent (the reference samples GenEval and OCR stochastically,
        PickScore with an ODE), and trains the velocity the sampler computes (CFG included)."""
        check_no_window_knobs(trainer, self.name)
        if sampling is not None:
            time_strata(sampling.num_steps, trainer.section(AwmConfig))


AWM = AdvantageWeightedMatching()
