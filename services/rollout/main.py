"""``flowgrpo serve rollout``: parse the config, then serve the rollout actor until drained."""

from __future__ import annotations

from flowgrpo.configs.rollout import RolloutServiceConfig
from flowgrpo.runtime import Service
from flowgrpo.runtime.launch import run_service
from flowgrpo.v1 import rollout_pb2_grpc

CONFIG = RolloutServiceConfig


def run(config: RolloutServiceConfig) -> None:
    from flowgrpo.services.rollout.service import RolloutService  # torch: imported only to serve

    actor = RolloutService(config)
    run_service(
        actor, config, [Service("flowgrpo.v1.Rollout", actor, rollout_pb2_grpc.add_RolloutServicer_to_server)]
    )
