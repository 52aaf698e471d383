"""GRPO-Guard (Wang et al., 2025): FlowGRPO with the ratio re-normalised against
over-optimisation (``trainer.loss.mode=grpo_guard``; docs/algorithms.md). Its targets and
columns are FlowGRPO's; the trainer's objective is :mod:`flowgrpo.algorithms.grpo_guard.objective`."""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

from flowgrpo.algorithms.flow_grpo import FlowGRPO

if TYPE_CHECKING:
    from flowgrpo.configs.trainer import TrainerConfig
    from flowgrpo.sampler_params import SamplerSettings


@dataclass(frozen=True)
class GRPOGuard(FlowGRPO):
    name: str = "grpo_guard"

    def check(self, trainer: TrainerConfig, sampling: SamplerSettings | None) -> None:
        if trainer.loss.logp_old == "bypass":
            raise ValueError(
                "trainer.loss.mode=grpo_guard compares the step means with the proximal policy's, "
                "which the recompute computes: use trainer.loss.logp_old=recompute"
            )
        if sampling is not None and sampling.sde_type != "sde":
            raise ValueError(
                f"trainer.loss.mode=grpo_guard re-normalises the ratio of a Gaussian step: it needs "
                f"sampling.sde_type=sde, not {sampling.sde_type!r}"
            )


GRPO_GUARD = GRPOGuard()
