"""The ``trainer.algorithm`` section of FlowGRPO (torch-free)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal


@dataclass
class FlowGrpoConfig:
    """``trainer.algorithm: flow_grpo``: the clipped policy gradient on the SDE window's
    log-probs. Its settings are the loss's (``trainer.loss``: clip, KL, the old policy's
    log-probs, GRPO-Guard's ratio with ``loss.mode=grpo_guard``), which the others share."""

    name: Literal["flow_grpo"] = "flow_grpo"
