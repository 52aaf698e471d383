"""``flowgrpo serve rollout``: parse the config, then serve the rollout actor until drained."""

from __future__ import annotations

import asyncio

from flowgrpo.logs import setup_logging
from flowgrpo.runtime import Service, serve
from flowgrpo.services.rollout.config import RolloutServiceConfig
from flowgrpo.telemetry import setup_tracing, shutdown_tracing
from flowgrpo.v1 import rollout_pb2_grpc

CONFIG = RolloutServiceConfig


def run(config: RolloutServiceConfig) -> None:
    from flowgrpo.services.rollout.service import RolloutService  # torch: imported only to serve

    actor = RolloutService(config)
    setup_logging("rollout", actor.replica_id, fmt=config.log_format)
    setup_tracing("rollout", replica_id=actor.replica_id, run_dir=config.run_dir or None)
    service = Service("flowgrpo.v1.Rollout", actor, rollout_pb2_grpc.add_RolloutServicer_to_server)
    try:
        asyncio.run(serve(actor, config.server, [service]))
    finally:
        shutdown_tracing()
