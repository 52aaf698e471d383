"""``flowgrpo sft`` on a GPU with ``autocast_bf16=true`` (GPU only): the compose base's setting at
the 300M size, every weight trained in fp32 and the matmuls on bf16 tensor cores. CUDA's autocast
and kernels against the fp32 run (no TF32), as test_sft.py checks the CPU's."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from .test_sft import assert_bf16_autocast_learns_as_fp32, setup

__all__ = ["setup"]  # the module-scoped drawer and pairs

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU"),
]


def test_bf16_autocast_on_a_gpu_learns_as_fp32_does(setup: tuple[Path, Path]) -> None:
    assert_bf16_autocast_learns_as_fp32(*setup, "device=cuda")
