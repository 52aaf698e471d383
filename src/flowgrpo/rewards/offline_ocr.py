"""Offline transcription with RapidOCR on onnxruntime: the PP-OCR detection, orientation and
recognition models ship inside the ``rapidocr`` wheel, so OCR rewards run with no server and no
download. rapidocr is imported when the engine is built, not with this module.

An image is read in up to two steps:

1. detection, then recognition of each box found (rapidocr's pipeline; the orientation
   classifier between them only when ``use_cls``);
2. only when step 1 reads nothing and ``rec_fallback`` is on: recognition alone on the *text
   band*, the crop of the rows and columns that differ from the background (the median colour of
   the border). The recogniser reads text too blurred or faint for the detector's box threshold;
   its line is kept when its confidence reaches ``text_score``, as step 1's boxes are. A blank
   image has no band and reads as nothing without running a model.

Images are read concurrently by a pool of ``workers`` threads: onnxruntime releases the GIL while
a model runs, and rapidocr's engine keeps no per-call state we rely on (its detector rebuilds
an identical pre-processor per call; the recogniser's batch is local).
"""

from __future__ import annotations

import logging
import os
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any, Literal

import numpy as np
import numpy.typing as npt

from flowgrpo.fields import knob
from flowgrpo.rewards.base import SampleError

log = logging.getLogger(__name__)

Path = Literal["detected", "band", "none"]  # which step read the text (module doc)
BAND_MIN_DEVIATION = 24  # a pixel this far (max over channels) from the background is ink...
BAND_SHARE = 0.25  # ... and so is one past this share of the image's largest deviation
BAND_MARGIN = 0.5  # the crop's margin around the band, as a share of its height (recogniser's padding)


@dataclass
class OfflineOcrConfig:
    # Detection input size: "max" shrinks images whose longer side exceeds limit_side_len and
    # leaves 512 px images alone; rapidocr's own default ("min", 736) enlarges every image so
    # its shorter side is 736, ~10x slower on small images.
    limit_type: Literal["max", "min"] = "max"
    limit_side_len: int = knob(960, 1, 2**15)
    text_score: float = knob(0.5, 0.0, 1.0)  # recognised lines below this confidence are dropped
    # onnxruntime intra-op threads per model run; 0: onnxruntime's default (all cores) with one
    # worker, else cores // workers (so the pool does not oversubscribe the machine)
    threads: int = knob(0, 0, 4096)
    # images read at once by a thread pool; small images keep few cores busy inside one run, so
    # a pool over images is where the throughput is (docs/rewards-ocr.md has the timings)
    workers: int = knob(1, 1, 256)
    # The orientation classifier, off as in flow_grpo (PaddleOCR built with use_angle_cls=False,
    # called with cls=False). rapidocr runs it by default; it turns short upright words 180
    # degrees and loses 1-4% of correctly read words (SPEC section 4).
    use_cls: bool = False
    # When detection reads nothing: recognition alone on the text band (module doc).
    rec_fallback: bool = True

    def validate(self) -> None:
        if self.limit_type not in ("max", "min"):
            raise ValueError(f"offline.limit_type {self.limit_type!r} is not 'max' or 'min'")
        if self.limit_side_len < 32:
            raise ValueError(f"offline.limit_side_len {self.limit_side_len} must be >= 32")
        if self.workers < 1:
            raise ValueError(f"offline.workers {self.workers} must be >= 1")

    def intra_op_threads(self) -> int:
        """Threads per model run; 0 leaves onnxruntime's default."""
        if self.threads or self.workers == 1:
            return self.threads
        return max(1, (os.cpu_count() or 1) // self.workers)


@dataclass(frozen=True)
class Reading:
    text: str  # the lines read, joined by spaces ("" when nothing was read)
    path: Path  # which step read it: "detected", "band" (the fallback) or "none"


class RapidOcrTranscriber:
    """A :class:`~flowgrpo.rewards.ocr.Transcriber`: the text lines RapidOCR finds, joined by spaces
    in its reading order (top to bottom, left to right); the text band's line when it finds none."""

    name = "rapidocr"

    def __init__(self, config: OfflineOcrConfig | None = None) -> None:
        self.config = config or OfflineOcrConfig()
        self.config.validate()
        self.engine = _build_engine(self.config, detect=True)
        # a second engine for recognition alone: passing use_det=False per call would set it on
        # the shared engine for every thread until set back
        self.recognizer = _build_engine(self.config, detect=False) if self.config.rec_fallback else None
        self._pool = ThreadPoolExecutor(self.config.workers) if self.config.workers > 1 else None

    def transcribe(self, images: Sequence[npt.NDArray[np.uint8]]) -> list[str | SampleError]:
        if self._pool is None or len(images) < 2:
            return [self.transcribe_one(image) for image in images]
        return list(self._pool.map(self.transcribe_one, images))

    def transcribe_one(self, image: npt.NDArray[np.uint8]) -> str | SampleError:
        try:
            return self.read(image).text
        except Exception as error:
            log.exception("rapidocr failed on an image of shape %s", image.shape)
            return SampleError("internal", f"rapidocr failed: {type(error).__name__}: {error}")

    def read(self, image: npt.NDArray[np.uint8]) -> Reading:
        """The text of one RGB uint8 [H, W, 3] image and the step that read it."""
        bgr = np.ascontiguousarray(image[:, :, ::-1])  # an array is read as BGR (OpenCV's order)
        texts = getattr(self.engine(bgr), "txts", None) or ()
        text = " ".join(str(t) for t in texts)
        if text.strip() or self.recognizer is None:
            return Reading(text, "detected" if text.strip() else "none")
        crop = text_band(bgr)
        if crop is None:
            return Reading("", "none")
        result = self.recognizer(np.ascontiguousarray(crop))
        lines = [
            str(t)
            for t, s in zip(result.txts or (), result.scores or (), strict=False)
            if s >= self.config.text_score and str(t).strip()
        ]
        return Reading(" ".join(lines), "band") if lines else Reading("", "none")

    def close(self) -> None:
        if self._pool is not None:
            self._pool.shutdown(wait=True)
            self._pool = None


def text_band(image: npt.NDArray[np.uint8]) -> npt.NDArray[np.uint8] | None:
    """The crop of ``image`` [H, W, C] around its ink: the pixels that differ from the background
    (the median of the border pixels) by BAND_MIN_DEVIATION, or by BAND_SHARE of the largest
    difference when that is more, plus a margin of BAND_MARGIN of the band's height on every
    side. None when no pixel differs (a blank image)."""
    border = np.concatenate([image[0], image[-1], image[:, 0], image[:, -1]])
    background = np.median(border, axis=0)
    deviation = np.abs(image.astype(np.int16) - background.astype(np.int16)).max(axis=2)
    peak = int(deviation.max())
    if peak < BAND_MIN_DEVIATION:
        return None
    ink = deviation >= max(BAND_MIN_DEVIATION, BAND_SHARE * peak)
    rows, columns = np.flatnonzero(ink.any(axis=1)), np.flatnonzero(ink.any(axis=0))
    margin = max(2, round(BAND_MARGIN * (rows[-1] - rows[0] + 1)))
    top, bottom = max(0, rows[0] - margin), min(image.shape[0], rows[-1] + 1 + margin)
    left, right = max(0, columns[0] - margin), min(image.shape[1], columns[-1] + 1 + margin)
    return image[top:bottom, left:right]


def _build_engine(config: OfflineOcrConfig, *, detect: bool) -> Any:
    try:
        from rapidocr import RapidOCR
    except ImportError as error:
        raise ImportError(
            "the offline OCR engine needs rapidocr and onnxruntime: pip install 'rapidocr>=3.4' onnxruntime"
        ) from error
    params: dict[str, Any] = {
        "Global.log_level": "error",
        "Global.text_score": config.text_score,
        "Global.use_det": detect,
        "Global.use_cls": config.use_cls and detect,
        "Det.limit_type": config.limit_type,
        "Det.limit_side_len": config.limit_side_len,
    }
    if threads := config.intra_op_threads():
        params["EngineConfig.onnxruntime.intra_op_num_threads"] = threads
    return RapidOCR(params=params)
