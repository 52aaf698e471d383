"""The training algorithms, one package each (docs/algorithms.md has their equations).

A package's ``__init__`` is the algorithm's torch-free spec (:class:`AlgorithmSpec`): the columns a
sample must carry, each sample's training target from its group's advantages (the coordinator
computes them and sends them), and the checks across config sections. Its ``objective`` module is
the trainer's side: the loss of a micro-batch and what the step computes before and after its
optimizer steps (:class:`flowgrpo.algorithms.objective.Objective`); the optimizer loop around it is
the trainer's one ``TrainStep``. Adding an algorithm: a package, its entry here, its tests.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from flowgrpo.algorithms.awm import AWM
from flowgrpo.algorithms.dgpo import DGPO
from flowgrpo.algorithms.diffusion_nft import DIFFUSION_NFT
from flowgrpo.algorithms.flow_grpo import FLOW_GRPO
from flowgrpo.algorithms.grpo_guard import GRPO_GUARD
from flowgrpo.algorithms.spec import AlgorithmSpec, Targets

if TYPE_CHECKING:
    from flowgrpo.configs.trainer import TrainerConfig

SPECS = (FLOW_GRPO, GRPO_GUARD, DIFFUSION_NFT, AWM, DGPO)
ALGORITHMS: dict[str, AlgorithmSpec] = {spec.name: spec for spec in SPECS}

__all__ = ["ALGORITHMS", "AlgorithmSpec", "Targets", "algorithm_of"]


def algorithm_of(trainer: TrainerConfig) -> AlgorithmSpec:
    """The algorithm a trainer config trains (GRPO-Guard is FlowGRPO's ``loss.mode=grpo_guard``)."""
    if trainer.algorithm.name == "flow_grpo" and trainer.loss.mode == "grpo_guard":
        return GRPO_GUARD
    return ALGORITHMS[trainer.algorithm.name]
