"""Data parallelism for the trainer: N processes launched by torchrun, the model sharded with
FSDP2 over :meth:`Dist.mesh` by ``flowgrpo.models.bagel.parallelize`` (never here, never in the
model). This module keeps the bookkeeping: which rows a rank runs, the all-reduces, and reading
or writing a possibly sharded parameter.

Every FSDP forward is a collective, so all ranks must run the same forwards: a rank takes every
``world``-th row of a mini-batch, and a rank left with fewer rows runs masked rows (weight 0) to
keep in step — masked, never real rows counted twice. Gradients are reduce-scattered (averaged)
by FSDP; the loss of each rank is scaled by ``world`` so the result is the mean over the whole
mini-batch, as in one process.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch
import torch.distributed as dist
from torch import Tensor

from flowgrpo.runtime.launch import end_process

if TYPE_CHECKING:
    from torch.distributed.device_mesh import DeviceMesh


@dataclass(frozen=True)
class Dist:
    rank: int = 0
    world: int = 1

    @property
    def enabled(self) -> bool:
        return self.world > 1

    def share(self, rows: list[int]) -> list[tuple[int, bool]]:
        """This rank's rows of ``rows`` as (row, valid), padded with masked rows to the same count
        on every rank."""
        own = rows[self.rank :: self.world]
        count = -(-len(rows) // self.world)
        return [(r, True) for r in own] + [(rows[0], False)] * (count - len(own))

    def sum(self, value: Tensor) -> Tensor:
        return _all_reduce(value, dist.ReduceOp.SUM) if self.enabled else value

    def max(self, value: Tensor) -> Tensor:
        return _all_reduce(value, dist.ReduceOp.MAX) if self.enabled else value

    def mesh(self, device: str) -> DeviceMesh | None:
        """The 1-D mesh of every rank that FSDP2 shards over; None for one process."""
        if not self.enabled:
            return None
        from torch.distributed.device_mesh import init_device_mesh

        return init_device_mesh("cuda" if device.startswith("cuda") else "cpu", (self.world,))


def _all_reduce(value: Tensor, op: dist.ReduceOp.RedOpType) -> Tensor:
    """In place; NCCL reduces only device tensors, so a host tensor (metrics, log-probs) makes a
    round trip through the current GPU."""
    if value.device.type == "cpu" and dist.get_backend() == "nccl":
        on_device = value.to(torch.device("cuda", torch.cuda.current_device()))
        dist.all_reduce(on_device, op=op)
        value.copy_(on_device)
        return value
    dist.all_reduce(value, op=op)
    return value


def init_distributed(device: str) -> Dist:
    """Join the torchrun job when there is one (WORLD_SIZE > 1); else a one-process Dist."""
    world = int(os.environ.get("WORLD_SIZE", "1"))
    if world <= 1:
        return Dist()
    if not dist.is_initialized():
        if device.startswith("cuda"):  # one GPU per process: torchrun's LOCAL_RANK picks it
            torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
        dist.init_process_group("nccl" if device.startswith("cuda") else "gloo")
    return Dist(rank=dist.get_rank(), world=dist.get_world_size())


def close_distributed() -> None:
    """Leave the torchrun job: a barrier (no rank tears down while another is in a collective),
    then destroy the process group. A process that exits with the group alive can abort in
    gloo's C++ teardown ("terminate called without an active exception") and fail the job."""
    if dist.is_initialized():
        dist.barrier()
        dist.destroy_process_group()


def end_rank() -> None:
    """The last call of a torchrun rank that finished its work (after :func:`close_distributed`):
    in a job of several ranks, end the process with exit status 0 without Python's finalization
    (:func:`flowgrpo.runtime.launch.end_process`); in one process, return.

    Why here too: FSDP2 keeps the process group alive past ``destroy_process_group`` (DTensor's
    sharding caches hold its DeviceMesh; measured on a 2-rank gloo job: its transport and both
    worker threads still run), and a rank torn down by the finalization aborted in about 1 of 17
    such CPU jobs. ``flowgrpo serve`` ends every service this way; this is for ranks started
    otherwise (the tests' workers)."""
    if int(os.environ.get("WORLD_SIZE", "1")) <= 1:
        return
    end_process()


def full_tensor(value: Tensor) -> Tensor:
    """The whole tensor of a (possibly sharded) parameter; a collective for DTensors."""
    gather = getattr(value, "full_tensor", None)
    return gather() if gather is not None else value


def local_tensor(value: Tensor) -> Tensor:
    """This rank's shard of a DTensor (a view: writes go to the parameter); ``value`` otherwise."""
    to_local = getattr(value, "to_local", None)
    return to_local() if to_local is not None else value


def shard_like(param: Tensor, full: Tensor) -> Tensor:
    """``full`` laid out like ``param``: sharded the same way when ``param`` is a DTensor. Every
    rank holds ``full`` (read from the same file) and keeps its slice: no communication."""
    placements = getattr(param, "placements", None)
    if placements is None:
        return full.to(param.device, param.dtype)
    from torch.distributed.tensor import distribute_tensor

    mesh = param.device_mesh  # type: ignore[attr-defined]
    return distribute_tensor(full.to(param.dtype), mesh, placements, src_data_rank=None)
