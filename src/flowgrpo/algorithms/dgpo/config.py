"""The ``trainer.algorithm`` section of DGPO (torch-free)."""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Literal

from flowgrpo.fields import knob


@dataclass
class DgpoConfig:
    """``trainer.algorithm: dgpo`` (docs/algorithms.md has the equations). Defaults: the reference
    code's GenEval recipe (Luo-Yihong/DGPO ``config/dgpo.py``), but beta (its OCR recipe and README:
    100; GenEval's 101) and the KL weight, which is ``trainer.loss.kl_beta`` (the reference: 0.02)."""

    name: Literal["dgpo"] = "dgpo"

    # the DPO temperature on a group's advantage-weighted denoising-error gap (beta_dpo); the
    # reference's EMA-reference recipe: 2000
    beta: float = knob(100.0, 0.0, 1e6)
    # advantages clipped to +-adv_clip before they weight the group (train.adv_clip_max)
    adv_clip: float = knob(5.0, 0.0, 1e6)
    # times trained per sample, distinct, shared by the whole step (num_train_timesteps) ...
    trained_times: int = knob(4, 1, 1000)
    # ... drawn from the schedule's first time_points points, the noisiest (trunc_steps + 1: 5 of
    # 10 for GenEval, 7 for OCR)
    time_points: int = knob(5, 1, 1000)
    # one noise per (group, time), as the reference's use_shared_noise; false: one per sample
    shared_noise: bool = True
    # the DPO reference: "base", the frozen loaded policy (adapters off for LoRA); "old", the
    # old policy below (use_ema_ref, with beta ~2000)
    reference: Literal["base", "old"] = "base"
    # text CFG of the frozen base's velocity, the DPO reference ("base") and the KL target
    # (kl_cfg): 1 is its conditional velocity; the CFG-free recipe's 4.5 distils guidance
    reference_cfg: float = knob(1.0, 1.0, 100.0)
    # a sample's gradient stops once its denoising error left the old policy's by more than
    # this ratio in the advantage's direction (clip_range; .inf: never)
    clip_range: float = knob(1e-2, 0.0, math.inf, infinite=True)
    # the old policy after each optimizer step: old <- d old + (1 - d) current, with
    # d = min(rate k, max) after k optimizer steps before it (the reference's ema_ref: 0.001, 0.3)
    old_decay_rate: float = knob(0.001, 0.0, 1.0)
    old_decay_max: float = knob(0.3, 0.0, 1.0)
    # rollouts sample with the old policy once more optimizer steps than this are done
    # (switch_ema_ref: 500 for GenEval and OCR, 200 for compressibility); before, with the trained one
    sample_old_after: int = knob(500, 0, 10**9)

    def validate(self) -> None:
        if self.beta <= 0 or self.adv_clip <= 0:
            raise ValueError(f"trainer.algorithm.beta={self.beta} and adv_clip={self.adv_clip} must be > 0")
        if self.trained_times > self.time_points:
            raise ValueError(
                f"trainer.algorithm.trained_times={self.trained_times} distinct times cannot be drawn from "
                f"trainer.algorithm.time_points={self.time_points} points: raise time_points or lower "
                "trained_times"
            )
        if not 0 <= self.old_decay_max < 1:
            raise ValueError(f"trainer.algorithm.old_decay_max={self.old_decay_max} must be in [0, 1)")

    def old_decay(self, optimizer_steps: int) -> float:
        """The old policy's decay for the update after ``optimizer_steps`` optimizer steps."""
        return min(optimizer_steps * self.old_decay_rate, self.old_decay_max)
