"""Fixtures of the benchmark smoke tests: one intra-op thread, here and in child processes (on
a busy 2-core machine, two spinning OpenMP threads per process slow the tiny model's steps by
an order of magnitude; the figures of a smoke run mean nothing anyway)."""

from __future__ import annotations

from collections.abc import Iterator

import pytest


@pytest.fixture(autouse=True)
def one_thread(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    import torch

    monkeypatch.setenv("OMP_NUM_THREADS", "1")
    previous = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(previous)
