"""``flowgrpo serve trainer``: parse the config, then serve the trainer actor until drained."""

from __future__ import annotations

import asyncio

from flowgrpo.logs import setup_logging
from flowgrpo.runtime import Service, serve
from flowgrpo.services.trainer.config import TrainerServiceConfig
from flowgrpo.telemetry import setup_tracing, shutdown_tracing
from flowgrpo.v1 import trainer_pb2_grpc

CONFIG = TrainerServiceConfig


def run(config: TrainerServiceConfig) -> None:
    from flowgrpo.services.trainer.service import TrainerService  # torch: imported only to serve

    actor = TrainerService(config)
    setup_logging("trainer", actor.replica_id, fmt=config.log_format)
    setup_tracing("trainer", replica_id=actor.replica_id, run_dir=config.run_dir or None)
    service = Service("flowgrpo.v1.Trainer", actor, trainer_pb2_grpc.add_TrainerServicer_to_server)
    try:
        asyncio.run(serve(actor, config.server, [service]))
    finally:
        shutdown_tracing()
