"""BAGEL's vLLM-Omni pipeline with FlowGRPO's sampler: this module runs inside vLLM-Omni's
diffusion worker (``custom_pipeline_args={"pipeline_class": PIPELINE_CLASS}``).

What it changes, and nothing else (vLLM-Omni's model code, KV caches, CFG and VAE run as shipped):

- the scheduler hook: every denoising step is this project's ``ode_step``, and the steps of the
  group's window are ``window_step`` (SDE or CPS) with noise drawn from the sample's coordinates;
  each window step's log-prob is recorded (vLLM-Omni returns them with the trajectory);
- the initial noise: ``initial_noise`` of the sample's coordinates (the group's with
  ``sampling.branch``), not torch's global RNG;
- the prompt: the request's token ids, not a re-tokenisation of text (one tokenisation, at data
  preparation; vLLM-Omni 0.30 takes text prompts only, so ``Bagel.prepare_prompts`` is wrapped);
- the autoencoder: built in the geometry of the checkpoint's ``ae.safetensors`` (vLLM-Omni
  hard-codes the published FLUX geometry, which a tiny test checkpoint does not have).

A request without the FlowGRPO arguments (vLLM-Omni's warm-up, a plain user request) runs the
stock pipeline. One sample per request: BAGEL's pipeline uses only the first prompt of a batch.
"""

from __future__ import annotations

import gc
from pathlib import Path
from typing import Any, ClassVar

import torch
from safetensors import safe_open
from torch import Tensor
from vllm_omni.diffusion.models.bagel.autoencoder import AutoEncoderParams, DistributedAutoEncoder
from vllm_omni.diffusion.models.bagel.pipeline_bagel import BagelPipeline, default_ae_params
from vllm_omni.diffusion.worker.diffusion_worker import CustomPipelineWorkerExtension

from flowgrpo.models.bagel.checkpoint import VAE_FILE, tensor_shapes
from flowgrpo.models.bagel.vae import vae_config_from_shapes
from flowgrpo.sampler_math import initial_noise
from flowgrpo.services.rollout.omni.request import OmniSampleRequest
from flowgrpo.services.rollout.omni.scheduler import FlowGrpoScheduler

PIPELINE_CLASS = f"{__name__}.FlowGrpoBagelPipeline"
WORKER_EXTENSION_CLASS = f"{__name__}.FlowGrpoWorkerExtension"


class FlowGrpoBagelPipeline(BagelPipeline):
    supports_step_execution: ClassVar[bool] = False  # the scheduler above is per request, not per step batch
    scheduler: FlowGrpoScheduler | None  # BAGEL's hook: set for the FlowGRPO request being drawn

    def __init__(self, *, od_config: Any, prefix: str = "") -> None:
        super().__init__(od_config=od_config, prefix=prefix)
        self._request: OmniSampleRequest | None = None
        self._stock_prepare_prompts = self.bagel.prepare_prompts
        self._stock_prepare_vae_latent = self.bagel.prepare_vae_latent
        self.bagel.prepare_prompts = self._prepare_prompts
        self.bagel.prepare_vae_latent = self._prepare_vae_latent
        self._size_autoencoder(od_config.model)

    def _size_autoencoder(self, folder: str) -> None:
        """Rebuild the autoencoder in the geometry ``ae.safetensors`` has, when it is not FLUX's."""
        cfg = vae_config_from_shapes(tensor_shapes(_local_file(folder, VAE_FILE)))
        published = default_ae_params()
        params = AutoEncoderParams(
            resolution=published.resolution,
            in_channels=cfg.in_channels,
            downsample=cfg.downsample,
            ch=cfg.ch,
            out_ch=cfg.out_channels,
            ch_mult=list(cfg.ch_mult),
            num_res_blocks=cfg.num_res_blocks,
            z_channels=cfg.z_channels,
            scale_factor=published.scale_factor,
            shift_factor=published.shift_factor,
        )
        if params != published:
            self.vae = DistributedAutoEncoder(params).to(next(self.bagel.parameters()).device)

    @torch.inference_mode()
    def forward(self, req: Any) -> Any:
        request = OmniSampleRequest.from_extra_args(getattr(req.sampling_params, "extra_args", None))
        if request is None:
            return super().forward(req)
        if len(req.prompts) != 1:
            raise ValueError(f"a FlowGRPO request draws one sample, got {len(req.prompts)} prompts")
        self._request, self.scheduler = request, FlowGrpoScheduler(request)
        try:
            return super().forward(req)
        finally:
            self._request, self.scheduler = None, None

    def _prepare_prompts(
        self,
        curr_kvlens: list[int],
        curr_rope: list[int],
        prompts: list[str],
        tokenizer: Any,
        new_token_ids: Any,
    ) -> tuple[dict[str, Tensor], list[int], list[int]]:
        """``Bagel.prepare_prompts`` with the request's token ids in place of the text's."""
        if self._request is None:
            return self._stock_prepare_prompts(curr_kvlens, curr_rope, prompts, tokenizer, new_token_ids)  # type: ignore[no-any-return]
        ids = list(self._request.prompt_ids)
        if len(prompts) != 1:
            raise ValueError(f"expected one prompt per FlowGRPO request, got {len(prompts)}")
        kv_len, position = curr_kvlens[0], curr_rope[0]
        inputs = {
            "text_token_lens": torch.tensor([len(ids)], dtype=torch.int),
            "packed_text_ids": torch.tensor(ids, dtype=torch.long),
            "packed_text_position_ids": torch.arange(position, position + len(ids), dtype=torch.long),
        }
        return inputs, [kv_len + len(ids)], [position + len(ids)]

    def _prepare_vae_latent(
        self,
        curr_kvlens: list[int],
        curr_rope: list[int],
        image_sizes: list[tuple[int, int]],
        new_token_ids: Any,
    ) -> dict[str, Tensor]:
        """``Bagel.prepare_vae_latent`` with the initial noise drawn from the sample's coordinates."""
        inputs: dict[str, Tensor] = self._stock_prepare_vae_latent(
            curr_kvlens, curr_rope, image_sizes, new_token_ids
        )
        request = self._request
        if request is not None:
            inputs["packed_init_noises"] = initial_noise(
                tuple(inputs["packed_init_noises"].shape),
                seed=request.seed,
                step=request.step,
                prompt_uid=request.prompt_uid,
                sample_index=request.sample_index,
                shared=request.sampler_params.branch,
            )
        return inputs


class FlowGrpoWorkerExtension(CustomPipelineWorkerExtension):
    """Methods added to vLLM-Omni's diffusion worker (``worker_extension_cls``), reached through
    ``collective_rpc``: policy updates arrive as a staged safetensors file (no pickle). It extends
    vLLM-Omni's own extension for custom pipelines, which a ``worker_extension_cls`` replaces."""

    model_runner: Any  # the worker's
    od_config: Any
    load_model: Any
    init_lora_manager: Any

    def flowgrpo_load_weights(self, path: str) -> int:
        """Load every tensor of ``path`` (published BAGEL names) into the pipeline in place, one name
        at a time, and fail naming any that vLLM-Omni did not place (its BAGEL loader skips a name it
        cannot place without a word: the "LoRA trains nothing" failure). Returns the count loaded."""
        pipeline = self.model_runner.pipeline
        dropped = []
        with safe_open(path, framework="pt") as f:
            names = list(f.keys())
            for name in names:
                if not pipeline.load_weights(iter([(name, f.get_tensor(name))])):
                    dropped.append(name)
        if dropped:
            raise RuntimeError(f"vLLM-Omni placed none of {len(dropped)} published tensors: {dropped[:8]}")
        return len(names)

    def flowgrpo_reload(self, folder: str) -> None:
        """Rebuild the pipeline from ``folder`` (a staged copy of the checkpoint with updated weights)."""
        self.od_config.model = folder
        # vLLM-Omni's re_init_pipeline, with the accelerator cache emptied only where there is one
        self.model_runner.pipeline = None
        gc.collect()
        if torch.accelerator.is_available():
            torch.accelerator.empty_cache()
        self.load_model(load_format="custom_pipeline", custom_pipeline_name=PIPELINE_CLASS)
        self.init_lora_manager()


def _local_file(folder: str, name: str) -> Path:
    path = Path(folder) / name
    if not path.is_file():
        raise FileNotFoundError(
            f"{path} does not exist: the FlowGRPO pipeline loads local checkpoint folders"
        )
    return path
