"""What the coordinator knows of a training algorithm, torch-free (each algorithm's package
``__init__`` defines one; its ``objective`` module is what the trainer computes)."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING, Protocol

if TYPE_CHECKING:
    from flowgrpo.configs.trainer import TrainerConfig
    from flowgrpo.sampler_params import SamplerSettings

Targets = dict[str, list[float]]  # prompt uid -> one training target per sample of its group


class AlgorithmSpec(Protocol):
    """An algorithm as the processes agree on it."""

    @property
    def name(self) -> str: ...

    @property
    def columns(self) -> tuple[str, ...]:
        """What a sample must carry to be trained on (column names, ``flowgrpo.columns``)."""
        ...

    def targets(self, advantages: Mapping[str, Sequence[float]], trainer: TrainerConfig) -> Targets:
        """Each sample's training target (``TrainSample.advantage``) from its group's advantages."""
        ...

    def check(self, trainer: TrainerConfig, sampling: SamplerSettings | None) -> None:
        """Raise ``ValueError`` naming the keys when the settings do not fit this algorithm
        (``sampling`` is None where a process has no sampler settings: a trainer on its own)."""
        ...
