"""The CPU's bitwise claims hold on every CPU of the kind CI runs on, not only on the one at hand.

A claim that held on AVX-512 machines once failed on an AMD EPYC (AVX2): two paths of the
scheduler's parity test ran their matmuls on different thread counts, which MKL's kernels there
split into different sums. The tests marked ``bitwise`` re-run here in a subprocess whose
kernels are restricted: ATen's to the baseline instruction set (``ATEN_CPU_CAPABILITY=default``:
no AVX2, no AVX-512), and ATen's and MKL's to AVX2 (``MKL_ENABLE_INSTRUCTIONS=AVX2``: the GEMM
kernels of a CPU without AVX-512). The subprocess reports the capability it ran with, so a
restriction torch ignored cannot pass for one that held."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
RESTRICTED = {
    "default": {"ATEN_CPU_CAPABILITY": "default"},
    "avx2": {"ATEN_CPU_CAPABILITY": "avx2", "MKL_ENABLE_INSTRUCTIONS": "AVX2"},
}
CAPABILITY = "import torch; print(torch.backends.cpu.get_cpu_capability())"


@pytest.mark.parametrize("isa", sorted(RESTRICTED))
def test_bitwise_claims_hold_on_a_restricted_instruction_set(isa: str) -> None:
    env = os.environ | RESTRICTED[isa]
    seen = subprocess.run(
        [sys.executable, "-c", CAPABILITY], env=env, capture_output=True, text=True, timeout=120
    )
    assert seen.stdout.strip().lower() == isa, (
        f"torch ran with {seen.stdout.strip()!r}: {seen.stderr[-2000:]}"
    )
    marks = "bitwise and not gpu and not slow and not vllm_omni"
    done = subprocess.run(
        [
            sys.executable,
            "-m",
            "pytest",
            "-q",
            "-p",
            "no:cacheprovider",
            "-o",
            "addopts=",
            "-m",
            marks,
            "tests",
        ],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=1200,
    )
    summary = done.stdout.strip().splitlines()[-1] if done.stdout.strip() else done.stderr[-2000:]
    assert done.returncode == 0, f"under {RESTRICTED[isa]}: {summary}\n{done.stdout[-6000:]}"
    assert " passed" in summary and " failed" not in summary, summary
