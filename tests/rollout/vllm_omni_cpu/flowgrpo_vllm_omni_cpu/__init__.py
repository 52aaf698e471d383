"""An out-of-tree vLLM-Omni platform for CPUs, for the project's tests only.

vLLM-Omni detects its platform through the ``vllm_omni.platform_plugins`` entry point group; this
plug-in activates when no accelerator is visible and vLLM itself runs on its CPU platform.
"""

from __future__ import annotations


def activate() -> str | None:
    from vllm.platforms import current_platform

    if not current_platform.is_cpu():
        return None
    return "flowgrpo_vllm_omni_cpu.platform.CpuOmniPlatform"
