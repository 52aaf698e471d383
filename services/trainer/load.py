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

from flowgrpo.models.bagel.checkpoint import (
    EMA_FILE,
    IGNORED_PREFIXES,
    check_keys,
    read_bagel_config,
    tensor_shapes,
)
from flowgrpo.models.bagel.model import BagelModel
from flowgrpo.models.bagel.parallelize import parallelize_bagel
from flowgrpo.services.trainer.config import PolicyConfig
from flowgrpo.services.trainer.distributed import Dist, local_tensor
from flowgrpo.services.trainer.policy import TrainablePolicy

BASE_LAYER = ".base_layer"  # peft keeps an adapted module's own weight under <module>.base_layer


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
    compile: bool = False,
) -> TrainablePolicy:
    """The trainable policy of ``folder``: frozen weights in ``dtype``, trainable ones fp32,
    FSDP2-sharded over ``dist`` when it has several ranks (``param_dtype``: the compute dtype of
    gathered parameters), the image-query path compiled and checkpointed when asked
    (``parallelize_bagel``: compile, activation checkpointing, FSDP, on the meta-device model)."""
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
        param_dtype=param_dtype,
    )
    policy.model.to_empty(device=torch.device(device))
    _stream_weights(policy.model, path)
    policy.init_adapters()
    if keep_reference:
        policy.keep_reference()
    return policy


def checkpoint_key(param_name: str) -> str | None:
    """The ``ema.safetensors`` key of a model parameter; None for a LoRA tensor (not in the file)."""
    if ".lora_A." in param_name or ".lora_B." in param_name:
        return None
    return param_name.replace(BASE_LAYER, "")


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
