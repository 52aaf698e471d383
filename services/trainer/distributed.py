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
        return _all_reduce(value, dist.ReduceOp.SUM) if self.enabled else value

    def max(self, value: Tensor) -> Tensor:
        return _all_reduce(value, dist.ReduceOp.MAX) if self.enabled else value


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


def shard_model(model: nn.Module, device: str, param_dtype: torch.dtype | None = None) -> nn.Module:
    """FSDP2: each decoder layer its own unit, then the root (embeddings, heads, norms).

    ``param_dtype`` (bf16 on GPU) is the compute dtype of the all-gathered parameters; the
    sharded trainable parameters and their optimizer state stay fp32; gradients reduce in fp32.
    Forward inputs are not cast: the model keeps RoPE and the latents in fp32 on purpose, and
    FSDP's input cast rebuilds dataclass arguments (the KVCache) with ``dataclasses.replace``,
    which its init=False fields refuse.
    """
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard, register_fsdp_forward_method

    mesh = init_device_mesh("cuda" if device.startswith("cuda") else "cpu", (dist.get_world_size(),))
    policy = MixedPrecisionPolicy(
        param_dtype=param_dtype, reduce_dtype=torch.float32, cast_forward_inputs=False
    )
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


def checkpoint_query_layers(model: nn.Module) -> None:
    """Activation checkpointing of the image-query path, applied from outside the model: each
    decoder layer's ``query_qkv`` and ``query_out`` (the per-layer work around the joint attention)
    keep only their inputs and run again in the backward. Saved per layer and row: the layer's
    input, q/k/v and the attention output: ~1.1 GiB per row (one CFG branch of one trajectory at
    one window step, 7B, 512px) against ~6.6 GiB without, for ~1/3 more update time. Without
    gradients (logp_old) the methods run plainly. Apply before or after ``shard_model`` (FSDP2
    skips its pre-forward during the backward's recompute); ``uncheckpoint_query_layers`` undoes it.
    """
    from torch.utils.checkpoint import checkpoint

    for layer in model.language_model.model.layers:  # type: ignore[union-attr]
        if "_flowgrpo_unchecked" in vars(layer):
            continue  # already checkpointed
        saved = {name: vars(layer).get(name) for name in _CHECKPOINTED}
        for name in _CHECKPOINTED:
            inner = getattr(layer, name)  # the class method, or a compiled / FSDP wrapper of it

            def run(*args: Tensor, _inner: object = inner) -> object:
                if torch.is_grad_enabled():
                    # no dropout or other randomness inside: no RNG state to stash and restore
                    return checkpoint(_inner, *args, use_reentrant=False, preserve_rng_state=False)
                return _inner(*args)  # type: ignore[operator]

            vars(layer)[name] = run
        vars(layer)["_flowgrpo_unchecked"] = saved


def uncheckpoint_query_layers(model: nn.Module) -> None:
    """Undo :func:`checkpoint_query_layers` (whatever the methods were before shows through)."""
    for layer in model.language_model.model.layers:  # type: ignore[union-attr]
        saved = vars(layer).pop("_flowgrpo_unchecked", None)
        if saved is None:
            continue
        for name, previous in saved.items():
            if previous is None:
                vars(layer).pop(name, None)
            else:
                vars(layer)[name] = previous


_CHECKPOINTED = ("query_qkv", "query_out")
