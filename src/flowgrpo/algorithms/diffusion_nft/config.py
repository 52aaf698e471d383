"""The ``trainer.algorithm`` section of DiffusionNFT (torch-free)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from flowgrpo.fields import knob


@dataclass
class NftConfig:
    """``trainer.algorithm: diffusion_nft`` (docs/algorithms.md has the equations). Defaults: the
    reference code's (NVlabs/DiffusionNFT, SD3.5-M PickScore)."""

    name: Literal["diffusion_nft"] = "diffusion_nft"

    # strength of the implicit policies v+- = v_old +- beta (v - v_old); 0.1 for OCR

    beta: float = knob(1.0, 0.0, 1e3)
    # advantages clipped to +-adv_clip, r = A / (2 adv_clip) + 1/2; scales the loss
    adv_clip: float = knob(5.0, 0.0, 1e6)
    # times trained per sample: int(fraction x steps) of the schedule's
    timestep_fraction: float = knob(0.99, 0.0, 1.0)
    # the old (sampling) policy after each training step: old <- d old + (1 - d) current, with
    # d = min(rate (k - after), max) after k optimizer steps in all (0 before ``after``), as the
    # reference counts its global steps; its default: after 0, rate 0.001, max 0.5; OCR: 75, 0.0075, 0.999
    old_decay_after: int = knob(0, 0, 10**9)
    old_decay_rate: float = knob(0.001, 0.0, 1.0)
    old_decay_max: float = knob(0.5, 0.0, 1.0)

    def validate(self) -> None:
        if self.beta <= 0 or self.adv_clip <= 0:
            raise ValueError(f"trainer.algorithm.beta={self.beta} and adv_clip={self.adv_clip} must be > 0")
        if not 0 < self.timestep_fraction <= 1:
            raise ValueError(
                f"trainer.algorithm.timestep_fraction={self.timestep_fraction} must be in (0, 1]"
            )
        if not 0 <= self.old_decay_max < 1 or self.old_decay_rate < 0 or self.old_decay_after < 0:
            raise ValueError(
                f"trainer.algorithm.old_decay_max={self.old_decay_max} must be in [0, 1), old_decay_rate "
                f"and old_decay_after >= 0 (got {self.old_decay_rate}, {self.old_decay_after})"
            )

    def old_decay(self, optimizer_steps: int) -> float:
        """The old policy's decay after ``optimizer_steps`` optimizer steps in all."""
        if optimizer_steps < self.old_decay_after:
            return 0.0
        return min((optimizer_steps - self.old_decay_after) * self.old_decay_rate, self.old_decay_max)

    def trained_times(self, num_steps: int) -> int:
        return max(1, int(num_steps * self.timestep_fraction))
