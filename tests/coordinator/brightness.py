"""A reward plug-in for the learning tests: the mean brightness of an image in [0, 1]. A second
reward beside JPEG compressibility, learnable in both directions (weight +1 and -1)."""

from __future__ import annotations

import numpy as np
import numpy.typing as npt


def brightness(
    images: list[npt.NDArray[np.uint8]],
    prompts: list[str],
    ground_truths: list[str],
    metadata: list[dict[str, str]],
) -> list[float]:
    return [float(image.mean()) / 255 for image in images]
