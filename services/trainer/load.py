"""Build the trainer's policy from a BAGEL checkpoint folder without the whole model ever
existing in one process: construct on the meta device, mark what trains (LoRA injected, or the
gen path unfrozen), shard with FSDP2, then materialise and stream the weights in — each rank
reads only its own rows of each tensor from ``ema.safetensors`` (memory-mapped).

Peak host memory is one tensor's shard, not the 28 GiB file; device memory is the rank's shard
of the model. With one process the same path runs without sharding, and the result equals
``load_bagel_model`` + ``TrainablePolicy`` (the tests check it).
"""

from __future__ import annotations

from pathlib import Path

import torch
from safetensors import safe_open
from torch import Tensor, nn

from flowgrpo.bus.cuda_ipc import BucketWriter, bucket_bytes
from flowgrpo.configs.trainer import PolicyConfig
from flowgrpo.models.bagel.checkpoint import (
    EMA_FILE,
    IGNORED_PREFIXES,
    check_keys,
    checkpoint_key,
    read_bagel_config,
    tensor_shapes,
)
from flowgrpo.models.bagel.model import BagelModel
from flowgrpo.models.bagel.parallelize import parallelize_bagel
from flowgrpo.services.trainer.distributed import Dist, local_tensor
from flowgrpo.services.trainer.policy import TrainablePolicy


def load_policy(
    folder: str | Path,
    config: PolicyConfig,
    dist: Dist,
    *,
    dtype: torch.dtype,
    device: str,
    param_dtype: torch.dtype | None = None,
    keep_reference: bool = False,
    activation_checkpointing: bool = False,
    checkpoint_every: int = 1,
    compile: bool = False,
    share_base: bool = False,
) -> TrainablePolicy:
    """The trainable policy of ``folder``: frozen weights in ``dtype``, trainable ones fp32,
    FSDP2-sharded over ``dist`` when it has several ranks (``param_dtype``: the compute dtype of
    gathered parameters), the image-query path compiled and checkpointed when asked
    (``parallelize_bagel``: compile, activation checkpointing, FSDP, on the meta-device model).

    ``share_base`` (one process): every frozen weight is a view into one allocation,
    ``policy.base_bucket``, which a GPU trainer exports by CUDA IPC so that rollouts on its GPU
    map the base instead of holding a copy (``TrainerCore``); the weights are placed there
    before anything else is allocated, so the base never exists twice."""
    path = Path(folder) / EMA_FILE
    with torch.device("meta"):
        model = BagelModel(read_bagel_config(folder)).to(dtype)
    policy = TrainablePolicy(model, config)  # on meta: nothing is drawn yet
    check_keys(_checkpoint_shapes(policy.model), tensor_shapes(path), path, IGNORED_PREFIXES)
    parallelize_bagel(
        policy.model,
        dist.mesh(device),
        compile=compile,
        activation_checkpointing=activation_checkpointing,
        checkpoint_every=checkpoint_every,
        param_dtype=param_dtype,
    )
    if share_base:
        if dist.enabled:
            raise ValueError("trainer.share_base needs one trainer process (FSDP shards the base)")
        policy.base_bucket = _frozen_into_bucket(policy.model, torch.device(device))
        _materialise(policy.model, torch.device(device))
    else:
        policy.model.to_empty(device=torch.device(device))
    _stream_weights(policy.model, path)
    policy.init_adapters()
    if keep_reference:
        policy.keep_reference()
    return policy


def _frozen_into_bucket(model: nn.Module, device: torch.device) -> BucketWriter:
    """Re-home every frozen (meta) parameter as a view into one new allocation on ``device``,
    named by its checkpoint key (the name a sampling model has for it)."""
    frozen = [(n, p) for n, p in model.named_parameters() if not p.requires_grad]
    writer = BucketWriter(bucket_bytes((checkpoint_key(n) or n, p.shape, p.dtype) for n, p in frozen), device)
    state = {n: writer.reserve(checkpoint_key(n) or n, p.shape, p.dtype) for n, p in frozen}
    model.load_state_dict(state, strict=False, assign=True)  # the views become the parameters
    return writer


def _materialise(model: nn.Module, device: torch.device) -> None:
    """``to_empty`` for what is still on the meta device (what the shared base did not take)."""
    meta = {n: t for n, t in model.state_dict(keep_vars=True).items() if t.is_meta}
    state = {n: torch.empty_like(t, device=device) for n, t in meta.items()}
    model.load_state_dict(state, strict=False, assign=True)  # keeps each parameter's requires_grad


def _checkpoint_shapes(model: nn.Module) -> dict[str, tuple[int, ...]]:
    keys = ((checkpoint_key(n), p) for n, p in model.named_parameters())
    return {key: tuple(p.shape) for key, p in keys if key is not None}


def _stream_weights(model: nn.Module, path: Path) -> None:
    """Copy each parameter's rows of this rank from the file, one tensor at a time."""
    with torch.no_grad(), safe_open(str(path), framework="pt") as f:
        for name, param in model.named_parameters():
            key = checkpoint_key(name)
            if key is None:
                continue
            local, rows = _local_rows(param)
            local.copy_(f.get_slice(key)[rows[0] : rows[1]] if rows else f.get_tensor(key))


def _local_rows(param: Tensor) -> tuple[Tensor, tuple[int, int] | None]:
    """This rank's piece of ``param`` and the rows of the full tensor it holds (None: all).

    FSDP2 shards dim 0 like ``torch.chunk``: rank r holds rows [r*c, min((r+1)*c, n)) with
    c = ceil(n / world), possibly none."""
    placements = getattr(param, "placements", None)
    if placements is None:
        return param, None
    local = local_tensor(param)
    (placement,) = placements
    if not placement.is_shard(0):
        raise NotImplementedError(f"loading a parameter placed {placement} (FSDP2 shards dim 0)")
    rank, world = param.device_mesh.get_local_rank(), param.device_mesh.size()  # type: ignore[attr-defined]
    rows = param.shape[0]
    chunk = -(-rows // world)
    lo = min(rank * chunk, rows)
    hi = min(lo + chunk, rows)
    if local.shape[0] != hi - lo:
        raise RuntimeError(
            f"unexpected FSDP2 shard: {local.shape[0]} local rows, expected {hi - lo} of {rows}"
        )
    return local, (lo, hi)
