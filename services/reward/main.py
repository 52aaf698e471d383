"""``flowgrpo serve reward``: parse the config, then serve the reward actor until drained."""

from __future__ import annotations

from flowgrpo.configs.reward import RewardServiceConfig
from flowgrpo.runtime import Service
from flowgrpo.runtime.launch import run_service
from flowgrpo.v1 import reward_pb2_grpc

CONFIG = RewardServiceConfig


def run(config: RewardServiceConfig) -> None:
    from flowgrpo.services.reward.service import RewardService  # scorers: imported only to serve

    actor = RewardService(config)
    run_service(
        actor, config, [Service("flowgrpo.v1.Reward", actor, reward_pb2_grpc.add_RewardServicer_to_server)]
    )
