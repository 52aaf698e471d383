"""vLLM-Omni's platform interface on top of vLLM's CPU platform: one "device", the host's memory,
SDPA attention for the diffusion models, no CUDA graphs, no inductor."""

from __future__ import annotations

from typing import Any

import psutil
import torch
from vllm.platforms.cpu import CpuPlatform
from vllm_omni.diffusion.attention.backends.registry import DiffusionAttentionBackendEnum
from vllm_omni.platforms.interface import OmniPlatform, OmniPlatformEnum


class CpuOmniPlatform(OmniPlatform, CpuPlatform):
    _omni_enum = OmniPlatformEnum.OOT

    @classmethod
    def get_omni_ar_worker_cls(cls) -> str:
        return "vllm.v1.worker.cpu_worker.CPUWorker"

    @classmethod
    def get_omni_generation_worker_cls(cls) -> str:
        return "vllm.v1.worker.cpu_worker.CPUWorker"

    @classmethod
    def get_default_stage_config_path(cls) -> str:
        return "vllm_omni/model_executor/stage_configs"

    @classmethod
    def get_diffusion_attn_backend_cls(
        cls, selected_backend: str | None, head_size: int, allow_trtllm_default: bool = False
    ) -> str:
        if selected_backend not in (None, "TORCH_SDPA"):
            raise ValueError(f"the CPU platform runs TORCH_SDPA attention only, not {selected_backend}")
        # The SDPA backend dispatches on the platform and has no CPU branch; its XPU branch is plain
        # torch SDPA with the broadcast mask, which is what a CPU runs. (Bound here, once the module
        # is imported: importing it while the platform is being made is circular.)
        from vllm_omni.diffusion.attention.backends.sdpa import SDPAImpl

        SDPAImpl.forward = SDPAImpl.forward_xpu  # type: ignore[method-assign]
        return DiffusionAttentionBackendEnum.TORCH_SDPA.get_path()

    @classmethod
    def supports_torch_inductor(cls) -> bool:
        return False

    @classmethod
    def supports_diffusion_dense_flash_attention(cls) -> bool:
        return False

    @classmethod
    def get_torch_device(cls, local_rank: int | None = None) -> torch.device:
        return torch.device("cpu")

    @classmethod
    def set_device(cls, device: torch.device) -> None:
        if device.type != "cpu":
            raise ValueError(f"the CPU platform cannot use device {device}")

    @classmethod
    def get_device_count(cls) -> int:
        return 1

    @classmethod
    def get_device_version(cls) -> str | None:
        return None

    @classmethod
    def synchronize(cls) -> None:
        pass

    @classmethod
    def record_device_event(cls) -> Any:
        return None

    @classmethod
    def get_free_memory(cls, device: torch.device | None = None) -> int:
        return int(psutil.virtual_memory().available)

    @classmethod
    def get_device_memory(cls, device: torch.device | None = None) -> tuple[int, int]:
        memory = psutil.virtual_memory()
        return int(memory.available), int(memory.total)

    @classmethod
    def supports_cpu_offload(cls) -> bool:
        return False

    # torch.cpu has no memory statistics: report none and free nothing
    @classmethod
    def empty_cache(cls) -> None:
        pass

    @classmethod
    def reset_peak_memory_stats(cls, device: Any = None) -> None:
        pass

    @classmethod
    def max_memory_allocated(cls, device: Any = None) -> int:
        return 0

    @classmethod
    def max_memory_reserved(cls, device: Any = None) -> int:
        return 0

    @classmethod
    def get_device_total_memory(cls, device_id: int = 0) -> int:
        return int(psutil.virtual_memory().total)

    @classmethod
    def get_device_name(cls, device_id: int = 0) -> str:
        return "cpu"
