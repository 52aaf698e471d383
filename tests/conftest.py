"""Suite-wide fixtures."""

from __future__ import annotations

import os
from collections.abc import Iterator

import pytest


@pytest.fixture(autouse=True)
def environment_restored() -> Iterator[None]:
    """Each test leaves the process environment as it found it. A test that let a token stay in
    ``FLOWGRPO_TOKEN`` made every later in-process server require it: 157 errors, far from the
    test that leaked it."""
    saved = dict(os.environ)
    yield
    if dict(os.environ) != saved:
        os.environ.clear()
        os.environ.update(saved)
