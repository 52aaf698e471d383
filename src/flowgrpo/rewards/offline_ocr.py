"""Offline transcription with RapidOCR on onnxruntime: the PP-OCR detection, orientation and
recognition models ship inside the ``rapidocr`` wheel, so OCR rewards run with no server and no
download. rapidocr is imported when the engine is built, not with this module."""

from __future__ import annotations

import logging
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Literal

import numpy as np
import numpy.typing as npt

from flowgrpo.fields import knob
from flowgrpo.rewards.base import SampleError

log = logging.getLogger(__name__)


@dataclass
class OfflineOcrConfig:
    # Detection input size: "max" shrinks images whose longer side exceeds limit_side_len and
    # leaves 512 px images alone; rapidocr's own default ("min", 736) enlarges every image so
    # its shorter side is 736, ~10x slower on small images.
    limit_type: Literal["max", "min"] = "max"
    limit_side_len: int = knob(960, 1, 2**15)
    text_score: float = knob(0.5, 0.0, 1.0)  # recognised boxes below this confidence are dropped
    threads: int = knob(0, 0, 4096)  # onnxruntime intra-op threads; 0: onnxruntime's default (all cores)

    def validate(self) -> None:
        if self.limit_type not in ("max", "min"):
            raise ValueError(f"offline.limit_type {self.limit_type!r} is not 'max' or 'min'")
        if self.limit_side_len < 32:
            raise ValueError(f"offline.limit_side_len {self.limit_side_len} must be >= 32")


class RapidOcrTranscriber:
    """A :class:`~flowgrpo.rewards.ocr.Transcriber`: the text lines RapidOCR finds, joined by spaces
    in its reading order (top to bottom, left to right)."""

    name = "rapidocr"

    def __init__(self, config: OfflineOcrConfig | None = None) -> None:
        self.config = config or OfflineOcrConfig()
        self.config.validate()
        self.engine = _build_engine(self.config)

    def transcribe(self, images: Sequence[npt.NDArray[np.uint8]]) -> list[str | SampleError]:
        return [self.transcribe_one(image) for image in images]

    def transcribe_one(self, image: npt.NDArray[np.uint8]) -> str | SampleError:
        try:
            # an array is read as BGR (OpenCV's order); ours are RGB
            result = self.engine(np.ascontiguousarray(image[:, :, ::-1]))
        except Exception as error:
            log.exception("rapidocr failed on an image of shape %s", image.shape)
            return SampleError("internal", f"rapidocr failed: {type(error).__name__}: {error}")
        texts = getattr(result, "txts", None) or ()
        return " ".join(str(t) for t in texts)

    def close(self) -> None:
        pass


def _build_engine(config: OfflineOcrConfig) -> Any:
    try:
        from rapidocr import RapidOCR
    except ImportError as error:
        raise ImportError(
            "the offline OCR engine needs rapidocr and onnxruntime: pip install 'rapidocr>=3.4' onnxruntime"
        ) from error
    params: dict[str, Any] = {
        "Global.log_level": "error",
        "Global.text_score": config.text_score,
        "Det.limit_type": config.limit_type,
        "Det.limit_side_len": config.limit_side_len,
    }
    if config.threads > 0:
        params["EngineConfig.onnxruntime.intra_op_num_threads"] = config.threads
    return RapidOCR(params=params)
