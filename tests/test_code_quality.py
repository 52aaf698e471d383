"""ruff on everything, mypy --strict on the library and every service, run as tests so CI enforces them."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


def _run(*cmd: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", *cmd], cwd=ROOT, capture_output=True, text=True, timeout=600)


def test_ruff_check() -> None:
    out = _run("ruff", "check", ".")
    assert out.returncode == 0, out.stdout + out.stderr


def test_ruff_format() -> None:
    out = _run("ruff", "format", "--check", ".")
    assert out.returncode == 0, "run `ruff format .`\n" + out.stdout + out.stderr


@pytest.mark.timeout(600)
def test_mypy_strict_on_the_library_and_every_service() -> None:
    out = _run("mypy")  # what it checks: [tool.mypy] in pyproject.toml
    assert out.returncode == 0, out.stdout + out.stderr
