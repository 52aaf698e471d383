"""``flowgrpo serve trainer``: parse the config, then serve the trainer actor until drained."""

from __future__ import annotations

from flowgrpo.runtime import Service
from flowgrpo.runtime.launch import run_service
from flowgrpo.services.trainer.config import TrainerServiceConfig
from flowgrpo.v1 import trainer_pb2_grpc

CONFIG = TrainerServiceConfig


def run(config: TrainerServiceConfig) -> None:
    from flowgrpo.services.trainer.service import TrainerService  # torch: imported only to serve

    actor = TrainerService(config)
    run_service(
        actor, config, [Service("flowgrpo.v1.Trainer", actor, trainer_pb2_grpc.add_TrainerServicer_to_server)]
    )
