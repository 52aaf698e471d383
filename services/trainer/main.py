"""``flowgrpo serve trainer``: one process, or every rank of ``torchrun ... -m flowgrpo.services.cli serve
trainer``: rank 0 serves gRPC, the other ranks follow it (FSDP2 data parallelism)."""

from __future__ import annotations

from flowgrpo.configs.trainer import TrainerServiceConfig
from flowgrpo.runtime import Service
from flowgrpo.runtime.launch import run_service
from flowgrpo.v1 import trainer_pb2_grpc

CONFIG = TrainerServiceConfig


def run(config: TrainerServiceConfig) -> None:
    # torch: imported only to serve
    from flowgrpo.services.trainer.distributed import close_distributed, init_distributed
    from flowgrpo.services.trainer.service import TrainerService, follow

    dist = init_distributed(config.trainer.device)
    if dist.rank > 0:
        follow(config, dist)
    else:
        actor = TrainerService(config, dist)
        service = Service("flowgrpo.v1.Trainer", actor, trainer_pb2_grpc.add_TrainerServicer_to_server)
        run_service(actor, config, [service])
    close_distributed()  # after STOP reached every rank: each leaves the job in step
