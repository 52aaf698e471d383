"""The trainer service's config (torch-free): ``flowgrpo serve trainer trainer.checkpoint=DIR ...``.
The ``trainer`` section itself is the library's (``flowgrpo.configs.trainer``); it is re-exported
here for the service's code."""

from __future__ import annotations

from dataclasses import dataclass, field

from flowgrpo.configs.trainer import (
    DEFAULT_LORA_TARGETS,
    Algorithm,
    AwmConfig,
    DgpoConfig,
    LossConfig,
    NftConfig,
    OptimConfig,
    PolicyConfig,
    TrainerConfig,
)
from flowgrpo.runtime.config import ServiceProcessConfig

__all__ = [
    "DEFAULT_LORA_TARGETS",
    "Algorithm",
    "AwmConfig",
    "DgpoConfig",
    "LossConfig",
    "NftConfig",
    "OptimConfig",
    "PolicyConfig",
    "TrainerConfig",
    "TrainerServiceConfig",
]


@dataclass
class TrainerServiceConfig(ServiceProcessConfig):
    trainer: TrainerConfig = field(default_factory=TrainerConfig)

    def validate(self) -> None:  # here, not in TrainerConfig: in a run config "" follows model.checkpoint
        super().validate()
        if not self.trainer.checkpoint:
            raise ValueError("trainer.checkpoint is empty: set it to a BAGEL checkpoint folder")
