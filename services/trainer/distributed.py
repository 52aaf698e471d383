"""Data parallelism for the trainer: N processes launched by torchrun, the model sharded with
FSDP2 (``fully_shard`` per decoder layer, then the root), applied here and never in the model.

Every FSDP forward is a collective, so all ranks must run the same forwards: a rank takes every
``world``-th row of a mini-batch, and a rank left with fewer rows runs masked rows (weight 0) to
keep in step — masked, never real rows counted twice. Gradients are reduce-scattered (averaged)
by FSDP; the loss of each rank is scaled by ``world`` so the result is the mean over the whole
mini-batch, as in one process.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import Tensor, nn


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
        if self.enabled:
            dist.all_reduce(value, op=dist.ReduceOp.SUM)
        return value

    def max(self, value: Tensor) -> Tensor:
        if self.enabled:
            dist.all_reduce(value, op=dist.ReduceOp.MAX)
        return value


def init_distributed(device: str) -> Dist:
    """Join the torchrun job when there is one (WORLD_SIZE > 1); else a one-process Dist."""
    world = int(os.environ.get("WORLD_SIZE", "1"))
    if world <= 1:
        return Dist()
    if not dist.is_initialized():
        dist.init_process_group("nccl" if device.startswith("cuda") else "gloo")
    return Dist(rank=dist.get_rank(), world=dist.get_world_size())


def shard_model(model: nn.Module, device: str, param_dtype: torch.dtype | None = None) -> nn.Module:
    """FSDP2: each decoder layer its own unit, then the root (embeddings, heads, norms).

    ``param_dtype`` (bf16 on GPU) is the compute dtype of the all-gathered parameters; the
    sharded trainable parameters and their optimizer state stay fp32; gradients reduce in fp32.
    """
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard, register_fsdp_forward_method

    mesh = init_device_mesh("cuda" if device.startswith("cuda") else "cpu", (dist.get_world_size(),))
    policy = MixedPrecisionPolicy(param_dtype=param_dtype, reduce_dtype=torch.float32)
    for layer in model.language_model.model.layers:  # type: ignore[union-attr]
        fully_shard(layer, mesh=mesh, mp_policy=policy)
        # the image-query path calls these two halves of a layer around the joint attention
        for method in ("query_qkv", "query_out"):
            register_fsdp_forward_method(layer, method)
    fully_shard(model, mesh=mesh, mp_policy=policy)
    for method in ("prefill", "predict_velocity"):  # the sampler's forwards, beside forward()
        register_fsdp_forward_method(model, method)
    return model


def full_tensor(value: Tensor) -> Tensor:
    """The whole tensor of a (possibly sharded) parameter; a collective for DTensors."""
    gather = getattr(value, "full_tensor", None)
    return gather() if gather is not None else value
