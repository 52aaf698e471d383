"""The ``rollout`` section and the rollout service's process config (torch-free):
``flowgrpo serve rollout rollout.checkpoint=DIR server.port=0``."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal

from flowgrpo.fields import knob
from flowgrpo.runtime.config import ServiceProcessConfig

BaseWeights = Literal["checkpoint", "trainer"]


@dataclass
class VllmOmniConfig:
    """``rollout.engine=vllm_omni`` only (docs/rollout-engines.md)."""

    deploy_config: str = ""  # a vLLM-Omni deploy YAML; "": its single-stage BAGEL deploy on rollout.device
    # how policy updates reach vLLM-Omni's pipeline: "in_place" (load_weights in the worker; GPUs),
    # "reload" (rebuild the pipeline from a staged folder; what works on a CPU), "auto": by device
    weight_sync: Literal["auto", "in_place", "reload"] = "auto"


@dataclass
class SyntheticConfig:
    """``rollout.engine=synthetic`` only: the load-test engine (services/rollout/synthetic.py)."""

    step_delay_s: float = knob(0.0, 0.0, 3600.0)  # simulated compute per denoising step of each batch

    def validate(self) -> None:
        if not 0 <= self.step_delay_s <= 60:
            raise ValueError(f"rollout.synthetic.step_delay_s={self.step_delay_s} must be in [0, 60]")


@dataclass
class EngineConfig:
    # "native": this project's PyTorch BAGEL sampler; "vllm_omni": vLLM-Omni's BAGEL pipeline with
    # this project's sampler math (needs vllm-omni installed; bfloat16, LoRA merged)
    # "synthetic": a LOAD-TEST engine that computes nothing (flowgrpo bench scale); never trains
    engine: Literal["native", "vllm_omni", "synthetic"] = "native"
    checkpoint: str = ""  # BAGEL folder in the published layout (ema.safetensors, ae.safetensors, ...)
    device: str = "cpu"  # "cuda", "cuda:1", "cpu"
    dtype: Literal["bfloat16", "float32"] = "float32"  # weights; sampler math always runs in fp32
    # the gen path's linear layers (the denoising loop's matmuls): "dtype", in rollout.dtype; "fp8",
    # e4m3 with row-wise scales (models/bagel/fp8.py: Hopper's FP8 tensor cores; on a CPU the same
    # numbers by PyTorch's reference kernel). FP8 samples come from another policy than the trainer's
    # bf16 one: FlowGRPO weights every sample by the truncated importance ratio (trainer.loss.is_cap)
    precision: Literal["dtype", "fp8"] = "dtype"
    # precision=fp8 on Hopper (read by nothing else): the GEMMs' fast accumulation (partial sums
    # never promoted to fp32; torchao's inference default). On an H100 at 512 px b8: 1.51x bf16's
    # images/s against 1.38x without, and the same log-prob gap to the trainer's bf16 policy
    # (the quantization's own dominates; `flowgrpo bench fp8 --fast-accum`, docs/fp8.md)
    fp8_fast_accum: bool = True
    # samples per forward batch; a request is split into such batches
    max_batch_samples: int = knob(32, 1, 65_536)
    # a Generate asking for more is refused (INVALID_ARGUMENT): bounded work per request, so a
    # deadline means something (the coordinator splits its draws into requests this size)
    max_request_samples: int = knob(512, 1, 1_000_000)
    # LoRA updates: "merge" into the weights (fast sampling) or run them unmerged through peft,
    # the trainer's own computation (behaviour == recomputed log-probs bitwise on CPU; slower)
    lora_mode: Literal["merge", "peft"] = "merge"
    compile: bool = True  # CUDA only: torch.compile the query path's per-layer halves (~20 s once)
    # "checkpoint": load the weights; "trainer": map the frozen base the trainer on this GPU
    # shares (trainer.share_base): the base is in GPU memory once (docs/colocated.md)
    base_weights: BaseWeights = "checkpoint"
    # give cached activation memory back to the GPU after each Generate (torch.cuda.empty_cache),
    # for the trainer sharing the GPU; allocated again by the next Generate
    release_memory: bool = False
    vllm_omni: VllmOmniConfig = field(default_factory=VllmOmniConfig)
    synthetic: SyntheticConfig = field(default_factory=SyntheticConfig)

    def validate(self) -> None:
        if (self.base_weights == "trainer" or self.release_memory) and not self.device.startswith("cuda"):
            raise ValueError(
                f"rollout.base_weights=trainer and rollout.release_memory are for a GPU rollout "
                f"(rollout.device={self.device!r}): set rollout.device=cuda or turn them off"
            )
        if self.base_weights == "trainer" and self.engine != "native":
            raise ValueError(
                "rollout.base_weights=trainer maps weights into the native engine's model: "
                f"use rollout.engine=native, not {self.engine}"
            )
        if self.max_batch_samples < 1:
            raise ValueError(f"rollout.max_batch_samples={self.max_batch_samples} must be >= 1")
        if self.max_request_samples < 1:
            raise ValueError(f"rollout.max_request_samples={self.max_request_samples} must be >= 1")
        if self.engine == "vllm_omni" and self.dtype != "bfloat16":
            raise ValueError(
                f"rollout.engine=vllm_omni samples in bfloat16 only (vLLM-Omni's BAGEL casts to it): "
                f"set rollout.dtype=bfloat16, not {self.dtype}"
            )
        if self.precision == "fp8":
            self._validate_fp8()
        if self.engine == "vllm_omni" and self.lora_mode != "merge":
            raise ValueError(
                "rollout.lora_mode=peft runs peft's unmerged LoRA layers, which only the native engine has: "
                "use rollout.lora_mode=merge with rollout.engine=vllm_omni"
            )

    def _validate_fp8(self) -> None:
        if self.engine != "native":
            raise ValueError(
                f"rollout.precision=fp8 is the native engine's: set rollout.engine=native, not {self.engine}"
            )
        if self.lora_mode != "merge":
            raise ValueError(
                "rollout.precision=fp8 quantizes the LoRA merged into the weights: "
                "set rollout.lora_mode=merge"
            )
        if self.device.startswith("cuda") and self.dtype != "bfloat16":
            raise ValueError(
                "rollout.precision=fp8 on a GPU writes its GEMMs' outputs in bfloat16: "
                "set rollout.dtype=bfloat16"
            )


@dataclass
class RolloutServiceConfig(ServiceProcessConfig):
    rollout: EngineConfig = field(default_factory=EngineConfig)

    def validate(self) -> None:  # here, not in EngineConfig: in a run config "" follows model.checkpoint
        super().validate()
        if not self.rollout.checkpoint:
            raise ValueError("rollout.checkpoint is empty: set it to a BAGEL checkpoint folder")
