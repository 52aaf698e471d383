"""Weight publication: after an update, the changed tensors go out in the policy-update format
(``flowgrpo.v1.WeightUpdate``); rollouts fetch and apply them.

Only what changed travels: the LoRA A/B tensors, or the trainable gen-path tensors — never the
frozen und path. Two paths, either or both (``trainer.publish_bus`` / ``publish_cuda_ipc``):

- the bus: each tensor copied to the host and put into this replica's store, fetched by any
  rollout anywhere;
- CUDA IPC (a GPU trainer): the tensors packed into one allocation on the trainer's GPU that a
  rollout on the same host opens and copies from device to device (``flowgrpo.bus.cuda_ipc``).

Tensors are gathered one at a time (a collective under FSDP: every rank publishes, rank 0
alone holds the store and the buckets), so one whole tensor exists at once besides the bucket.
Each version is kept under its own store tag / bucket; the one before it stays for replicas
still fetching, older ones are released.
"""

from __future__ import annotations

import torch

from flowgrpo.bus import TensorStore
from flowgrpo.bus.cuda_ipc import Bucket, BucketWriter, bucket_bytes
from flowgrpo.bus.relay import KEEP_VERSIONS, version_tag
from flowgrpo.bus.torch_tensors import put_tensor
from flowgrpo.services.trainer.policy import TrainablePolicy
from flowgrpo.v1 import common_pb2


class Publisher:
    """Publishes the policy's versions. ``store`` is None on ranks > 0 (they join the gathers)."""

    def __init__(
        self,
        policy: TrainablePolicy,
        store: TensorStore | None,
        dtype: str = "",
        bus: bool = True,
        cuda_ipc: bool = False,
        *,
        base: Bucket | None = None,
    ) -> None:
        self.policy = policy
        self.base = base  # trainer.share_base: the frozen weights' bucket, named in every update
        self.store = store
        self.cast = getattr(torch, dtype) if dtype else None
        self.bus = bus
        self.cuda_ipc = cuda_ipc
        self.buckets: dict[int, Bucket] = {}  # version -> cuda_ipc.Bucket (kept alive for readers)

    def publish(self, version: int) -> common_pb2.WeightUpdate:
        """Gather and publish the current trainable tensors as ``version`` (every rank calls it;
        the update is meaningful on rank 0)."""
        self._release(version - KEEP_VERSIONS)  # before allocating: two versions at most, this one too
        writer = self._bucket_writer() if self.cuda_ipc and self.store is not None else None
        tag = version_tag(version)
        update = common_pb2.WeightUpdate(
            policy_version=version, kind="lora" if self.policy.kind == "lora" else "gen_path"
        )
        if self.base is not None:
            update.base.CopyFrom(self.base.proto)
        if self.policy.kind == "lora":
            update.lora.rank, update.lora.alpha = self.policy.config.lora_rank, self.policy.config.lora_alpha
        if self.store is not None and self.bus:
            self.store.release(tag=tag)  # a re-publication of the same version replaces it
        for name, tensor in self.policy.iter_published():
            if self.store is None:
                continue  # a follower: the gather was its part
            value = tensor.to(self.cast) if self.cast is not None else tensor
            if writer is not None:
                writer.add(name, value)
            if self.bus:
                ref = put_tensor(
                    self.store, f"{tag}/{name}", "weights", value, policy_version=version, tag=tag
                )
                update.tensors.append(common_pb2.NamedTensor(name=name, ref=ref.to_proto()))
        if writer is not None:
            bucket = writer.finish()
            self.buckets[version] = bucket
            update.cuda_ipc.append(bucket.proto)
        return update

    def initial(self) -> common_pb2.WeightUpdate:
        """What a rollout loads before the first publication: nothing, or the shared base."""
        update = common_pb2.WeightUpdate()
        if self.base is not None:
            update.base.CopyFrom(self.base.proto)
        return update

    def close(self) -> None:
        """Release every kept version (its store tag and its bucket)."""
        for version in list(self.buckets):
            del self.buckets[version]
        if self.store is not None and self.bus:
            self.store.release(prefix=version_tag(0).removesuffix("0"))  # every "weights/v..." key

    def _bucket_writer(self) -> BucketWriter:
        specs = [(n, shape, self.cast or dtype) for n, shape, dtype in self.policy.published_specs()]
        device = next(iter(self.policy.trainable().values())).device
        return BucketWriter(bucket_bytes(specs), device)

    def _release(self, version: int) -> None:
        for old in [v for v in self.buckets if v <= version]:
            del self.buckets[old]  # torch keeps the block mapped until readers let go of it
        if version < 0:
            return
        if self.store is not None and self.bus:
            self.store.release(tag=version_tag(version))
