"""DGPO (Luo et al., 2025): direct group preference optimization on the forward process, the clean
latents of any sampler (docs/algorithms.md). The coordinator's targets are the group advantages
clipped to +-``trainer.algorithm.adv_clip``; the trainer's objective is
:mod:`flowgrpo.algorithms.dgpo.objective`."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

from flowgrpo.algorithms.dgpo.config import DgpoConfig
from flowgrpo.algorithms.flow_grpo import check_no_window_knobs
from flowgrpo.algorithms.spec import Targets

if TYPE_CHECKING:
    from flowgrpo.configs.trainer import TrainerConfig
    from flowgrpo.sampler_params import SamplerSettings


def clipped_advantages(advantages: Sequence[float], clip: float) -> list[float]:
    """The advantages as they weight a group's samples: clipped to [-clip, clip], as the reference
    clips them before its loss (which then sums slightly off zero over a group: rare, it says)."""
    return [min(max(float(a), -clip), clip) for a in advantages]


@dataclass(frozen=True)
class DgpoSpec:
    name: str = "dgpo"
    columns: tuple[str, ...] = ("prompt_ids", "final_latents")  # the clean latent: no window, no log-prob

    def targets(self, advantages: Mapping[str, Sequence[float]], trainer: TrainerConfig) -> Targets:
        return {
            uid: clipped_advantages(values, trainer.section(DgpoConfig).adv_clip)
            for uid, values in advantages.items()
        }

    def check(self, trainer: TrainerConfig, sampling: SamplerSettings | None) -> None:
        check_no_window_knobs(trainer, self.name)
        dgpo = trainer.section(DgpoConfig)
        if sampling is not None and dgpo.time_points > sampling.num_steps:
            raise ValueError(
                f"trainer.algorithm.time_points={dgpo.time_points} exceeds the schedule's "
                f"{sampling.num_steps} steps (sampling.num_points={sampling.num_points}): lower it or "
                "raise sampling.num_points"
            )


DGPO = DgpoSpec()
