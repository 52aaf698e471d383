"""Dtype names on the wire, without torch.

A tensor travels as raw bytes plus its torch dtype name ("bfloat16", "float8_e4m3fn", ...).
This table gives each name's item size and the numpy dtype that holds it on a consumer without
torch: the native numpy dtype where numpy has one, otherwise an unsigned integer of the same
size (bfloat16 -> uint16, float8 -> uint8), tagged with the real name so
``flowgrpo.bus.torch_tensors`` can view the bytes as the right torch dtype.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

import numpy as np

# Names numpy represents natively (same name, same bytes as torch).
_NATIVE = (
    "float64",
    "float32",
    "float16",
    "complex128",
    "complex64",
    "int64",
    "int32",
    "int16",
    "int8",
    "uint64",
    "uint32",
    "uint16",
    "uint8",
    "bool",
)

# Torch dtypes numpy lacks, by item size in bytes. The sub-byte and "bits" types of torch are
# stored one element per byte, so they travel as bytes too.
_RAW_ITEMSIZE = {
    "bfloat16": 2,
    "complex32": 4,
    "float8_e4m3fn": 1,
    "float8_e5m2": 1,
    "float8_e4m3fnuz": 1,
    "float8_e5m2fnuz": 1,
    "float8_e8m0fnu": 1,
    "float4_e2m1fn_x2": 1,
    "bits8": 1,
    "bits16": 2,
    "bits1x8": 1,
    "bits2x4": 1,
    "bits4x2": 1,
    **{f"int{n}": 1 for n in range(1, 8)},
    **{f"uint{n}": 1 for n in range(1, 8)},
}

STORAGE: dict[str, np.dtype[Any]] = {name: np.dtype(name) for name in _NATIVE}
STORAGE.update({name: np.dtype(f"uint{8 * size}") for name, size in _RAW_ITEMSIZE.items()})


def storage_dtype(name: str) -> np.dtype[Any]:
    """The numpy dtype that holds tensors of dtype ``name``; ValueError names the known ones."""
    try:
        return STORAGE[name]
    except KeyError:
        raise ValueError(
            f"dtype {name!r} cannot travel on the bus; known: {', '.join(sorted(STORAGE))}"
        ) from None


def itemsize(name: str) -> int:
    return storage_dtype(name).itemsize


def nbytes_of(name: str, shape: Sequence[int]) -> int:
    return itemsize(name) * math.prod(shape)


def name_of(dtype: np.dtype[Any]) -> str:
    """The wire name of a numpy dtype; refuses object, string, big-endian and other dtypes."""
    if dtype.name in _NATIVE and dtype.isnative:
        return dtype.name
    raise ValueError(
        f"numpy dtype {dtype.str} ({dtype.name}) cannot travel on the bus: only native-endian "
        f"{', '.join(_NATIVE)} (wrap other torch dtypes' bytes in TensorBytes with their name)"
    )
