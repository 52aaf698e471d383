"""Ranks > 0 of a torchrun trainer follow rank 0, which alone serves gRPC.

Every trainer operation runs collectives (FSDP all-gathers, gradient reduce-scatters, the
gathers of published weights), so all ranks must run the same operations in the same order.
Before each one, rank 0 broadcasts a command — an op code and the request's protobuf bytes, as
tensors on a gloo group, never pickle — and the followers run the same code path with the same
request. Followers fetch their own data from the bus. ``STOP`` ends them after rank 0 drained.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field

import torch
import torch.distributed as dist
from torch.distributed import ProcessGroup

log = logging.getLogger(__name__)

STOP, TRAIN, SAVE = 0, 1, 2
OP_NAMES = {STOP: "STOP", TRAIN: "TRAIN", SAVE: "SAVE"}


@dataclass
class CommandChannel:
    """Rank 0 sends commands, every other rank receives them (a gloo group: CPU tensors)."""

    group: ProcessGroup | None = field(default=None)

    @classmethod
    def create(cls) -> CommandChannel:
        return cls(dist.new_group(backend="gloo"))

    def send(self, op: int, payload: bytes = b"") -> None:
        header = torch.tensor([op, len(payload)], dtype=torch.int64)
        dist.broadcast(header, src=0, group=self.group)
        if payload:
            dist.broadcast(torch.frombuffer(bytearray(payload), dtype=torch.uint8), src=0, group=self.group)

    def receive(self) -> tuple[int, bytes]:
        header = torch.zeros(2, dtype=torch.int64)
        dist.broadcast(header, src=0, group=self.group)
        op, size = int(header[0]), int(header[1])
        if op not in OP_NAMES:
            raise RuntimeError(f"rank {dist.get_rank()}: unknown trainer command {op} from rank 0")
        payload = torch.zeros(size, dtype=torch.uint8)
        if size:
            dist.broadcast(payload, src=0, group=self.group)
        return op, payload.numpy().tobytes()
