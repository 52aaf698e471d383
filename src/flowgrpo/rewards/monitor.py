"""Image statistics to watch for reward hacking, as scorers: add them with weight 0 and their
curves show what the policy does to its images while it chases the reward (a JPEG-compressibility
policy flattening its images shows as falling edge density; a brightness drift as brightness).
Numpy only, no weights.

- ``image_brightness``: mean luminance (0.299 R + 0.587 G + 0.114 B) in [0, 1];
- ``image_edge_density``: the share of pixels whose luminance gradient (Sobel, in [0, 1] units per
  pixel) exceeds ``EDGE_THRESHOLD``: 0 for a flat image, near 1 for noise.
"""

from __future__ import annotations

import time
from collections.abc import Sequence

import numpy as np
import numpy.typing as npt

from flowgrpo.rewards.base import Outcome, Sample, SampleScore, Scorer

MONITORS = ("image_brightness", "image_edge_density")
EDGE_THRESHOLD = 0.1  # luminance change per pixel (of 1.0): a visible edge, not JPEG-level noise


def luminance(image: npt.NDArray[np.uint8]) -> npt.NDArray[np.float64]:
    """[H, W] in [0, 1] (ITU-R BT.601 weights) of a uint8 [H, W, 3] image."""
    weights = np.array([0.299, 0.587, 0.114]) / 255.0
    out: npt.NDArray[np.float64] = np.asarray(image, dtype=np.float64) @ weights
    return out


def edge_density(image: npt.NDArray[np.uint8], threshold: float = EDGE_THRESHOLD) -> float:
    """Share of interior pixels whose Sobel gradient magnitude (normalised by the kernel's weight
    8, so a unit step reads 1) exceeds ``threshold``."""
    y = luminance(image)
    if min(y.shape) < 3:
        return 0.0
    gx = (y[:-2, 2:] + 2 * y[1:-1, 2:] + y[2:, 2:] - y[:-2, :-2] - 2 * y[1:-1, :-2] - y[2:, :-2]) / 8.0
    gy = (y[2:, :-2] + 2 * y[2:, 1:-1] + y[2:, 2:] - y[:-2, :-2] - 2 * y[:-2, 1:-1] - y[:-2, 2:]) / 8.0
    return float((np.hypot(gx, gy) > threshold).mean())


class SyntheticScorer(Scorer):
    """The LOAD-TEST scorer (``name: synthetic``, flowgrpo bench scale): ``delay_s`` of simulated
    work per image, then the image's mean luminance as its score (a function of the image, so a
    retried sample scores the same)."""

    def __init__(self, delay_s: float) -> None:
        self.name, self.delay_s = "synthetic", delay_s

    def score(self, samples: Sequence[Sample]) -> list[Outcome]:
        if self.delay_s:
            time.sleep(self.delay_s * len(samples))
        return [SampleScore(float(luminance(s.image).mean())) for s in samples]


class ImageStatScorer(Scorer):
    def __init__(self, name: str) -> None:
        if name not in MONITORS:
            raise ValueError(f"unknown image statistic {name!r}: {', '.join(MONITORS)}")
        self.name = name

    def score(self, samples: Sequence[Sample]) -> list[Outcome]:
        if self.name == "image_brightness":
            return [SampleScore(float(luminance(s.image).mean())) for s in samples]
        return [SampleScore(edge_density(s.image)) for s in samples]
