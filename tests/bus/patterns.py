"""Deterministic test tensors: the same (dtype, shape, seed) gives the same bytes in every process."""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from flowgrpo.bus import TensorBytes
from flowgrpo.bus.dtypes import nbytes_of


def pattern(dtype: str, shape: Sequence[int], seed: int) -> TensorBytes:
    """Random bytes as a tensor of ``dtype``; bools are 0/1 so every consumer reads them alike."""
    raw = np.random.default_rng(seed).integers(0, 256, nbytes_of(dtype, shape), dtype=np.uint8)
    if dtype == "bool":
        raw &= 1
    return TensorBytes(raw, dtype, tuple(shape))
