"""JPEG compressibility (the DDPO idea, flow_grpo's scale): reward = -(JPEG size in kB at
quality 95) / 500, so smaller files score higher; incompressibility is its negative. Needs no
weights: the CPU demo's reward."""

from __future__ import annotations

import io
from collections.abc import Sequence

import numpy as np
import numpy.typing as npt
from PIL import Image

from flowgrpo.rewards.base import Outcome, Sample, SampleScore, Scorer

KB = 1000  # flow_grpo divides the byte count by 1000
SCALE_KB = 500.0


def jpeg_kb(image: npt.NDArray[np.uint8], quality: int = 95) -> float:
    """Size in kB (1000 bytes) of ``image`` (uint8 [H, W, 3]) saved as JPEG at ``quality``."""
    buffer = io.BytesIO()
    Image.fromarray(image, mode="RGB").save(buffer, format="JPEG", quality=quality)
    return buffer.tell() / KB


class JpegScorer(Scorer):
    """``-kB / 500`` (compressibility) or ``+kB / 500`` (``incompressible=True``)."""

    def __init__(self, name: str = "", *, incompressible: bool = False, quality: int = 95) -> None:
        if not 1 <= quality <= 100:
            raise ValueError(f"JPEG quality {quality} is outside 1..100")
        self.name = name or ("jpeg_incompressibility" if incompressible else "jpeg_compressibility")
        self.sign = 1.0 if incompressible else -1.0
        self.quality = quality

    def score(self, samples: Sequence[Sample]) -> list[Outcome]:
        return [SampleScore(self.sign * jpeg_kb(s.image, self.quality) / SCALE_KB) for s in samples]
