"""The rollout engine interface and its native BAGEL implementation.

:class:`RolloutEngine` is what the rollout service needs from a sampler: trajectories with
behaviour log-probs for a batch of samples, atomic policy updates, and the version it holds.
:class:`NativeBagelEngine` implements it with our PyTorch BAGEL (the default: the fastest we
measured); ``flowgrpo.services.rollout.omni.engine.VllmOmniBagelEngine`` implements it on
vLLM-Omni's BAGEL pipeline with the same sampler math (``rollout.engine=vllm_omni``).
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Protocol

import torch

from flowgrpo.bus import cuda_ipc
from flowgrpo.configs.rollout import BaseWeights
from flowgrpo.models.bagel.checkpoint import (
    load_bagel_model,
    load_special_tokens,
    load_vae,
    read_bagel_config,
)
from flowgrpo.models.bagel.config import is_gen_path
from flowgrpo.models.bagel.fp8 import check_fp8_device, quantize_gen_path
from flowgrpo.models.bagel.model import BagelModel
from flowgrpo.models.bagel.parallelize import parallelize_bagel
from flowgrpo.models.bagel.policy import LoraMode, PolicyApplier, PolicyUpdate
from flowgrpo.models.bagel.sampling import (
    BagelSampler,
    SampleRequest,
    Trajectories,
    concat_trajectories,
)
from flowgrpo.sampler_params import SamplerParams
from flowgrpo.services.rollout.shared_base import attach_base
from flowgrpo.v1 import common_pb2

log = logging.getLogger(__name__)
# images per decode on a CPU: channels-last in batches of 16, the 64 px decode of 128 images took
# 0.45x the time of one plain batch on 2 cores; batches of 4 took 0.83x the time of 16 on one
# thread and pad a small batch less (docs/LOG.md, 2026-12-05 morning), the same images
CPU_DECODE_BATCH = 4


class RolloutEngine(Protocol):
    @property
    def policy_version(self) -> int: ...

    def generate(
        self,
        requests: Sequence[SampleRequest],
        params: SamplerParams,
        *,
        seed: int,
        step: int,
        between_steps: Callable[[], None] | None = None,
    ) -> Trajectories:
        """Row i of the result belongs to request i; results never depend on the batch split.
        ``between_steps`` is called before every denoising step (it may raise to stop)."""
        ...

    def apply_update(self, update: PolicyUpdate) -> None:
        """Apply a whole update or nothing (a refused update leaves the engine as it was)."""
        ...

    def close(self) -> None:
        """Free what the engine holds outside this process's memory (worker processes, files)."""
        ...


class NativeBagelEngine:
    """Our PyTorch BAGEL sampler; samples in batches of at most ``max_batch_samples``."""

    def __init__(
        self,
        sampler: BagelSampler,
        max_batch_samples: int,
        lora_mode: LoraMode = "merge",
        base_from: str | Path | None = None,
        fp8_bases: dict[str, torch.Tensor] | None = None,
    ) -> None:
        self.sampler = sampler
        self.max_batch_samples = max_batch_samples
        self._policy = PolicyApplier(sampler.model, lora_mode=lora_mode)
        # rollout.precision=fp8: the gen path's weights before quantization, what LoRA merges onto
        # (none when the trainer's shared base is that)
        self._policy.keep_bases(fp8_bases or {})
        # rollout.base_weights=trainer: the checkpoint for what the trainer does not share; the
        # model stays on the meta device until attach_base maps the trainer's base
        self.base_from = base_from
        self.base: common_pb2.CudaIpcBucket | None = None  # the trainer allocation mapped now

    @classmethod
    def from_checkpoint(
        cls,
        folder: str | Path,
        *,
        device: str,
        dtype: torch.dtype,
        max_batch_samples: int,
        lora_mode: LoraMode = "merge",
        compile: bool = False,
        base_weights: BaseWeights = "checkpoint",
        fp8: bool = False,
        fp8_fast_accum: bool = True,  # rollout.fp8_fast_accum's default
    ) -> NativeBagelEngine:
        if fp8:
            check_fp8_device(device)
        if base_weights == "trainer":  # the weights come with the first update (attach_base)
            with torch.device("meta"):
                model = BagelModel(read_bagel_config(folder)).to(dtype).eval().requires_grad_(False)
        else:
            model = load_bagel_model(folder, dtype=dtype, device=device).eval()
        # before compile: it traces the FP8 layers
        fp8_bases = quantize_gen_path(model, fast_accum=fp8_fast_accum) if fp8 else None
        on_gpu = str(device).startswith("cuda")
        parallelize_bagel(model, None, compile=compile and on_gpu, activation_checkpointing=False)
        vae = load_vae(folder, dtype=dtype, device=device).eval()
        if not on_gpu:  # oneDNN's channels-last convolutions in batches that stay in cache
            vae.to(memory_format=torch.channels_last)  # type: ignore[call-overload]  # torch's stub omits it
        log.info(
            "loaded BAGEL from %s on %s (%s%s; base weights: %s)",
            folder, device, dtype, ", the gen path's linear layers in FP8" if fp8 else "", base_weights,
        )  # fmt: skip
        decode_batch = 0 if on_gpu else CPU_DECODE_BATCH
        sampler = BagelSampler(model, vae, load_special_tokens(folder), decode_batch=decode_batch)
        base_from = folder if base_weights == "trainer" else None
        return cls(sampler, max_batch_samples, lora_mode, base_from=base_from, fp8_bases=fp8_bases)

    @property
    def policy_version(self) -> int:
        return self._policy.version

    def generate(
        self,
        requests: Sequence[SampleRequest],
        params: SamplerParams,
        *,
        seed: int,
        step: int,
        between_steps: Callable[[], None] | None = None,
    ) -> Trajectories:
        self._needs_weights()
        size = self.max_batch_samples
        parts = [
            self.sampler.generate(
                requests[i : i + size], params, seed=seed, step=step, between_steps=between_steps
            )
            for i in range(0, len(requests), size)
        ]
        return parts[0] if len(parts) == 1 else concat_trajectories(parts)

    def apply_update(self, update: PolicyUpdate) -> None:
        self._needs_weights()
        self._policy.apply(update)

    @property
    def waiting_for_base(self) -> bool:
        return self.base_from is not None and self.base is None

    def attach_base(self, bucket: common_pb2.CudaIpcBucket) -> bool:
        """Map the trainer's base weights (``rollout.base_weights=trainer``); False when this
        engine loads its own or already maps this very allocation."""
        if self.base_from is None or (self.base is not None and _same_allocation(self.base, bucket)):
            return False
        views = cuda_ipc.open_bucket(bucket)
        shared, merge_bases = attach_base(
            self.sampler.model,
            views,
            owned=lambda key: self._policy.lora_mode == "merge" and is_gen_path(key),
            checkpoint=self.base_from,
        )
        self._policy.shared_base, self._policy.read_only = merge_bases, shared
        self.base = bucket
        log.info("mapped %d of the trainer's base tensors (%d shared)", len(views), len(shared))
        return True

    def close(self) -> None:
        pass  # everything it holds is this process's memory (mapped memory is unmapped with it)

    def _needs_weights(self) -> None:
        if self.waiting_for_base:
            raise BaseWeightsMissing(
                "this rollout maps the trainer's base weights (rollout.base_weights=trainer) and has "
                "not received them: the coordinator sends them with the first LoadWeights "
                "(trainer.share_base=true, the trainer on this GPU)"
            )


class BaseWeightsMissing(RuntimeError):
    """Work asked of a rollout that waits for the trainer's shared base."""


def _same_allocation(a: common_pb2.CudaIpcBucket, b: common_pb2.CudaIpcBucket) -> bool:
    return (a.host_id, a.device_uuid, a.handle, a.storage_offset) == (
        b.host_id,
        b.device_uuid,
        b.handle,
        b.storage_offset,
    )
