"""DiffusionNFT (Zheng et al., 2025): training on the forward process, the clean latents of any
sampler (docs/algorithms.md). The coordinator's targets are the optimalities
r = clip(A, -c, c) / (2 c) + 1/2 in [0, 1] (``trainer.algorithm.adv_clip`` = c); the trainer's objective
is :mod:`flowgrpo.algorithms.diffusion_nft.objective`."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

import numpy as np

from flowgrpo.algorithms.diffusion_nft.config import NftConfig
from flowgrpo.algorithms.flow_grpo import check_no_window_knobs
from flowgrpo.algorithms.spec import Targets

if TYPE_CHECKING:
    from flowgrpo.configs.trainer import TrainerConfig
    from flowgrpo.sampler_params import SamplerSettings


def optimality(advantages: Sequence[float], clip: float) -> list[float]:
    """DiffusionNFT's r per sample: A clipped to [-clip, clip], mapped linearly onto [0, 1]
    (A = 0, the group's mean, is r = 1/2: neither positive nor negative)."""
    r = np.clip(np.asarray(advantages, dtype=np.float64), -clip, clip) / (2.0 * clip) + 0.5
    return [float(x) for x in np.clip(r, 0.0, 1.0)]  # the clamp: as the reference's, against rounding


@dataclass(frozen=True)
class DiffusionNFT:
    name: str = "diffusion_nft"
    columns: tuple[str, ...] = ("prompt_ids", "final_latents")  # the clean latent: no window, no log-prob

    def targets(self, advantages: Mapping[str, Sequence[float]], trainer: TrainerConfig) -> Targets:
        return {
            uid: optimality(values, trainer.section(NftConfig).adv_clip) for uid, values in advantages.items()
        }

    def check(self, trainer: TrainerConfig, sampling: SamplerSettings | None) -> None:
        check_no_window_knobs(trainer, self.name)


DIFFUSION_NFT = DiffusionNFT()
