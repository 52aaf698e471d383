"""Fixtures of the dataset tests: a real tiny checkpoint (its tokenizer) and our own prompt files."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest

PROMPTS = Path(__file__).with_name("prompts")


@pytest.fixture(scope="session")
def tiny_checkpoint(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from flowgrpo.models.bagel.checkpoint import make_tiny_bagel

    return make_tiny_bagel(tmp_path_factory.mktemp("data") / "tiny")


@pytest.fixture
def prompts(tmp_path: Path) -> Path:
    """A writable copy of tests/data/prompts (``pickscore/``, ``ocr/`` and ``compose/``)."""
    return Path(shutil.copytree(PROMPTS, tmp_path / "prompts"))
