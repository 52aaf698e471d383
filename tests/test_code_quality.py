"""ruff on everything, mypy --strict on the torch-free library, run as tests so CI enforces them."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
# Modules that import torch are type-checked by their own tests, not by mypy --strict here.
TORCH_FREE = ["flowgrpo"]
TORCH_MODULES = ["flowgrpo/bus/torch_tensors.py"]


def _run(*cmd: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", *cmd], cwd=ROOT, capture_output=True, text=True, timeout=600)


def test_ruff_check() -> None:
    out = _run("ruff", "check", ".")
    assert out.returncode == 0, out.stdout + out.stderr


def test_ruff_format() -> None:
    out = _run("ruff", "format", "--check", ".")
    assert out.returncode == 0, "run `ruff format .`\n" + out.stdout + out.stderr


@pytest.mark.timeout(600)
def test_mypy_strict_on_torch_free_modules() -> None:
    excludes = [arg for path in TORCH_MODULES for arg in ("--exclude", path)]
    out = _run("mypy", *excludes, *TORCH_FREE)
    assert out.returncode == 0, out.stdout + out.stderr
