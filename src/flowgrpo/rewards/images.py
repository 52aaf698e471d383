"""The one image format scorers accept: uint8 [H, W, 3] RGB (what the rollout decodes, column
"images"). Anything else is refused with a message that names the problem and the fix."""

from __future__ import annotations

from typing import Any

import numpy as np
import numpy.typing as npt

FORMAT = "uint8 [H, W, 3] RGB in 0..255"
MAX_SIDE = 8192  # pixels: no generator here draws more; a larger array is refused before it is read


class ImageError(ValueError):
    """An image is not uint8 [H, W, 3]."""


def check_image(image: object, where: str = "image") -> npt.NDArray[np.uint8]:
    """``image`` as a C-contiguous uint8 [H, W, 3] array; raise :class:`ImageError` otherwise."""
    if not isinstance(image, np.ndarray):
        raise ImageError(f"{where}: expected a numpy array ({FORMAT}), got {type(image).__name__}")
    if image.ndim == 3 and max(image.shape[:2]) > MAX_SIDE:  # before the dtype check scans it
        raise ImageError(f"{where}: {image.shape[0]} x {image.shape[1]} pixels; at most {MAX_SIDE} a side")
    _check_dtype(image, where)
    if image.ndim != 3 or image.shape[2] != 3:
        hint = " (channels first? transpose to HWC)" if image.ndim == 3 and image.shape[0] == 3 else ""
        raise ImageError(f"{where}: shape {list(image.shape)} is not [H, W, 3]{hint}; expected {FORMAT}")
    if image.shape[0] == 0 or image.shape[1] == 0:
        raise ImageError(f"{where}: empty image of shape {list(image.shape)}")
    return np.ascontiguousarray(image)


def _check_dtype(image: npt.NDArray[Any], where: str) -> None:
    if image.dtype == np.uint8:
        return
    if np.issubdtype(image.dtype, np.floating) or np.issubdtype(image.dtype, np.complexfloating):
        bad = int(np.count_nonzero(~np.isfinite(image)))
        if bad:
            raise ImageError(
                f"{where}: {bad} NaN or infinite value(s) in a {image.dtype} image; the generator "
                f"produced invalid pixels (expected {FORMAT})"
            )
    raise ImageError(
        f"{where}: dtype {image.dtype} is not uint8; expected {FORMAT} "
        "(from floats in [0, 1]: (x * 255).round().clip(0, 255).astype(np.uint8))"
    )
