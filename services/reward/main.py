"""``flowgrpo serve reward``: parse the config, then serve the reward actor until drained."""

from __future__ import annotations

import asyncio

from flowgrpo.logs import setup_logging
from flowgrpo.runtime import Service, serve
from flowgrpo.services.reward.config import RewardServiceConfig
from flowgrpo.telemetry import setup_tracing, shutdown_tracing
from flowgrpo.v1 import reward_pb2_grpc

CONFIG = RewardServiceConfig


def run(config: RewardServiceConfig) -> None:
    from flowgrpo.services.reward.service import RewardService  # scorers: imported only to serve

    actor = RewardService(config)
    setup_logging("reward", actor.replica_id, fmt=config.log_format)
    setup_tracing("reward", replica_id=actor.replica_id, run_dir=config.run_dir or None)
    service = Service("flowgrpo.v1.Reward", actor, reward_pb2_grpc.add_RewardServicer_to_server)
    try:
        asyncio.run(serve(actor, config.server, [service]))
    finally:
        shutdown_tracing()
