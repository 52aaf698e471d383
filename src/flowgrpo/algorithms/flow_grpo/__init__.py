"""FlowGRPO (Liu et al., 2025): the clipped policy gradient on the log-probs of the SDE window's
steps (docs/algorithms.md). The coordinator's targets are the group advantages as they are; the
trainer's objective is :mod:`flowgrpo.algorithms.flow_grpo.objective`."""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

from flowgrpo.algorithms.spec import Targets

if TYPE_CHECKING:
    from flowgrpo.configs.trainer import TrainerConfig
    from flowgrpo.sampler_params import SamplerSettings

WINDOW_COLUMNS = ("prompt_ids", "latents", "log_probs", "sigmas")  # the SDE window as the rollout stored it


@dataclass(frozen=True)
class FlowGRPO:
    name: str = "flow_grpo"
    columns: tuple[str, ...] = WINDOW_COLUMNS

    def targets(self, advantages: Mapping[str, Sequence[float]], trainer: TrainerConfig) -> Targets:
        return {uid: [float(a) for a in values] for uid, values in advantages.items()}

    def check(self, trainer: TrainerConfig, sampling: SamplerSettings | None) -> None:
        """FlowGRPO's loss knobs are checked by ``LossConfig.validate``; nothing crosses sections."""


def check_no_window_knobs(trainer: TrainerConfig, algorithm: str) -> None:
    """For algorithms without window log-probs: the FlowGRPO knobs that would silently do nothing."""
    loss = trainer.loss
    for key in ("max_logp_gap", "max_fp8_logp_gap"):
        if not math.isinf(getattr(loss, key)):
            raise ValueError(
                f"trainer.loss.{key} compares FlowGRPO's window log-probs; trainer.algorithm="
                f"{algorithm} computes none: leave it at .inf"
            )
    if loss.mode != "flow_grpo":
        raise ValueError(
            f"trainer.loss.mode={loss.mode} is a FlowGRPO loss; trainer.algorithm={algorithm} "
            "has its own: leave trainer.loss.mode=flow_grpo"
        )


FLOW_GRPO = FlowGRPO()
