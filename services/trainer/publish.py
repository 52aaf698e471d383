"""Weight publication: after an update, the changed tensors go on the bus in the policy-update
format (``flowgrpo.v1.WeightUpdate``); rollouts fetch them (batched, pipelined) and apply them.

Only what changed travels: the LoRA A/B tensors, or the trainable gen-path tensors — never the
frozen und path. Each version is kept under its own store tag; the one before it stays for
replicas still fetching, older ones are released.
"""

from __future__ import annotations

import torch

from flowgrpo.bus import TensorStore
from flowgrpo.bus.torch_tensors import put_tensor
from flowgrpo.services.trainer.policy import TrainablePolicy
from flowgrpo.v1 import common_pb2

KEEP_VERSIONS = 2


def version_tag(version: int) -> str:
    return f"weights/v{version}"


def publish(
    store: TensorStore,
    policy: TrainablePolicy,
    version: int,
    dtype: str = "",
    tensors: dict[str, torch.Tensor] | None = None,
) -> common_pb2.WeightUpdate:
    """Put the policy's published tensors (``tensors`` when already gathered) into ``store`` and
    describe them."""
    tag = version_tag(version)
    store.release(tag=tag)  # a re-publication of the same version replaces it
    update = common_pb2.WeightUpdate(
        policy_version=version, kind="lora" if policy.kind == "lora" else "gen_path"
    )
    if policy.kind == "lora":
        update.lora.rank, update.lora.alpha = policy.config.lora_rank, policy.config.lora_alpha
    cast = getattr(torch, dtype) if dtype else None
    for name, tensor in (policy.published() if tensors is None else tensors).items():
        value = tensor.to(cast) if cast is not None else tensor
        ref = put_tensor(store, f"{tag}/{name}", "weights", value, policy_version=version, tag=tag)
        update.tensors.append(common_pb2.NamedTensor(name=name, ref=ref.to_proto()))
    if version - KEEP_VERSIONS >= 0:
        store.release(tag=version_tag(version - KEEP_VERSIONS))
    return update
