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

from flowgrpo.models.bagel.checkpoint import load_bagel_model, load_special_tokens, load_vae
from flowgrpo.models.bagel.parallelize import parallelize_bagel
from flowgrpo.models.bagel.policy import LoraMode, PolicyApplier, PolicyUpdate
from flowgrpo.models.bagel.sampling import (
    BagelSampler,
    SampleRequest,
    Trajectories,
    concat_trajectories,
)
from flowgrpo.sampler_params import SamplerParams

log = logging.getLogger(__name__)


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

    def __init__(self, sampler: BagelSampler, max_batch_samples: int, lora_mode: LoraMode = "merge") -> None:
        self.sampler = sampler
        self.max_batch_samples = max_batch_samples
        self._policy = PolicyApplier(sampler.model, lora_mode=lora_mode)

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
    ) -> NativeBagelEngine:
        model = load_bagel_model(folder, dtype=dtype, device=device).eval()
        on_gpu = str(device).startswith("cuda")
        parallelize_bagel(model, None, compile=compile and on_gpu, activation_checkpointing=False)
        vae = load_vae(folder, dtype=dtype, device=device).eval()
        log.info("loaded BAGEL from %s on %s (%s)", folder, device, dtype)
        return cls(BagelSampler(model, vae, load_special_tokens(folder)), max_batch_samples, lora_mode)

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
        size = self.max_batch_samples
        parts = [
            self.sampler.generate(
                requests[i : i + size], params, seed=seed, step=step, between_steps=between_steps
            )
            for i in range(0, len(requests), size)
        ]
        return parts[0] if len(parts) == 1 else concat_trajectories(parts)

    def apply_update(self, update: PolicyUpdate) -> None:
        self._policy.apply(update)

    def close(self) -> None:
        pass  # everything it holds is this process's memory
