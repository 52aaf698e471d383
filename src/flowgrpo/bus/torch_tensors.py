"""Torch tensors on the bus: every dtype that ``tensor.view(torch.uint8)`` supports.

A tensor travels as its raw bytes plus its dtype name, so bfloat16, float8, complex32 and the
other dtypes numpy lacks move bit-exactly. Import this module only where torch is installed;
the rest of the bus never imports torch.
"""

from __future__ import annotations

import warnings
from typing import Any

import numpy as np
import torch

from flowgrpo.bus import dtypes
from flowgrpo.bus.refs import Fetched, TensorBytes, TensorRef
from flowgrpo.bus.store import TensorStore


def _viewable_dtypes() -> dict[str, torch.dtype]:
    """Every torch dtype whose tensors have a byte view. Quantized dtypes are left out: their
    values also need a scale and zero point, which the bus does not carry."""
    found = {}
    for name in dir(torch):
        dtype = getattr(torch, name)
        if isinstance(dtype, torch.dtype) and name == dtype_name(dtype):
            with warnings.catch_warnings():  # complex32 is "experimental", quantized "deprecated"
                warnings.simplefilter("ignore")
                probe = torch.empty(2, dtype=dtype)
            try:
                probe.view(torch.uint8)
            except (RuntimeError, TypeError):
                continue
            if not probe.is_quantized:
                found[name] = dtype
    return found


def dtype_name(dtype: torch.dtype) -> str:
    """The wire name of a torch dtype: ``torch.bfloat16`` -> "bfloat16"."""
    return str(dtype).removeprefix("torch.")


TORCH_DTYPES: dict[str, torch.dtype] = _viewable_dtypes()


def torch_dtype(name: str) -> torch.dtype:
    try:
        return TORCH_DTYPES[name]
    except KeyError:
        raise ValueError(
            f"no torch dtype {name!r} with a byte view; known: {', '.join(sorted(TORCH_DTYPES))}"
        ) from None


def _byte_view(tensor: torch.Tensor) -> torch.Tensor:
    """The tensor's bytes as a flat uint8 tensor (no copy for a contiguous CPU tensor)."""
    return tensor.detach().contiguous().reshape(-1).view(torch.uint8)


def to_tensor_bytes(tensor: torch.Tensor) -> TensorBytes:
    """A CPU copy of ``tensor`` (or a view, when it is already CPU and contiguous) as TensorBytes."""
    flat = _byte_view(tensor.detach().cpu())
    return TensorBytes(flat.numpy(), dtype_name(tensor.dtype), tuple(tensor.shape))


def put_tensor(
    store: TensorStore,
    key: str,
    column: str,
    tensor: torch.Tensor,
    *,
    policy_version: int = -1,
    tag: str | None = None,
    trace: dict[str, str] | None = None,
) -> TensorRef:
    """Put ``tensor`` (any device) into ``store`` with one copy, straight into the store's memory
    (shared memory for large tensors), then commit it."""
    name = dtype_name(tensor.dtype)
    target = store.allocate(
        key, column, name, tuple(tensor.shape), policy_version=policy_version, tag=tag, trace=trace
    )
    try:
        # byte to byte: torch has no copy kernel for some dtypes (int1 ...), and none is needed
        torch.from_numpy(target.reshape(-1).view(np.uint8)).copy_(_byte_view(tensor))
    except BaseException:
        store.abort(key)
        raise
    return store.commit(key)


def as_torch(array: np.ndarray[Any, Any], dtype: str) -> torch.Tensor:
    """A torch view (no copy) of a storage array holding tensors of dtype ``dtype``."""
    if array.size == 0:  # numpy gives empty arrays stride 0, which torch refuses to re-view
        return torch.empty(array.shape, dtype=torch_dtype(dtype))
    flat = torch.from_numpy(array.reshape(-1).view(np.uint8))
    return flat.view(torch_dtype(dtype)).reshape(array.shape)


def to_torch(fetched: Fetched) -> torch.Tensor:
    """The fetched tensor as torch, sharing the fetched array's memory (no copy)."""
    if fetched.array.dtype != dtypes.storage_dtype(fetched.dtype):
        raise ValueError(
            f"array of {fetched.key!r} has numpy dtype {fetched.array.dtype}, not the storage "
            f"dtype of {fetched.dtype}"
        )
    return as_torch(fetched.array, fetched.dtype)
