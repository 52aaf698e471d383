"""The ``trainer.algorithm`` section of AWM (torch-free)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from flowgrpo.fields import knob


@dataclass
class AwmConfig:
    """``trainer.algorithm: awm``, Advantage Weighted Matching (docs/algorithms.md has the
    equations). Defaults: the reference code's GenEval recipe (scxue/advantage_weighted_matching,
    SD3.5-M); its KL to the reference policy is ``trainer.loss.kl_beta`` (GenEval and OCR 3e-3,
    PickScore 1e-4)."""

    name: Literal["awm"] = "awm"

    # advantages clipped to +-adv_clip and divided by it: each sample's weight A in [-1, 1]
    adv_clip: float = knob(5.0, 0.0, 1e6)
    # times trained per sample: one in each of train_times equal strata of the schedule's points
    # [first, int(timestep_fraction x steps)), first = 0 with from_first_point (PickScore), else 1
    # (GenEval, OCR: t = 1, pure noise, is never trained)
    train_times: int = knob(6, 1, 10_000)
    timestep_fraction: float = knob(0.9, 0.0, 1.0)
    from_first_point: bool = False
    # the matching loss t ((mse + 1e-10)^p - 1e-10^p) / p of the velocity's mse ("ghuber"):
    # 0.25 in every reference recipe; 1 is the t-weighted mse
    loss_power: float = knob(0.25, 0.0, 1.0)
    # the pull toward an average of the past policies: ema_kl_beta mean((v - v_ema)^2); after each
    # training step ema <- d ema + (1 - d) current, d = min(rate k, max) after k optimizer steps in
    # all, as the reference counts its global steps (rate 0.001, max 0.3). 0: no average is kept
    ema_kl_beta: float = knob(1.0, 0.0, 1e6)
    ema_decay_rate: float = knob(0.001, 0.0, 1.0)
    ema_decay_max: float = knob(0.3, 0.0, 1.0)

    def validate(self) -> None:
        if self.adv_clip <= 0 or self.loss_power <= 0:
            raise ValueError(
                f"trainer.algorithm.adv_clip={self.adv_clip} and loss_power={self.loss_power} must be > 0"
            )
        if not 0 < self.timestep_fraction <= 1:
            raise ValueError(
                f"trainer.algorithm.timestep_fraction={self.timestep_fraction} must be in (0, 1]"
            )
        if not 0 <= self.ema_decay_max < 1:
            raise ValueError(f"trainer.algorithm.ema_decay_max={self.ema_decay_max} must be in [0, 1)")

    def ema_decay(self, optimizer_steps: int) -> float:
        """The average's decay after ``optimizer_steps`` optimizer steps in all."""
        return min(optimizer_steps * self.ema_decay_rate, self.ema_decay_max)
