"""The offline OCR engine (RapidOCR, weights inside its wheel) reads words rendered with PIL."""

from __future__ import annotations

from collections.abc import Iterator

import numpy as np
import numpy.typing as npt
import pytest
from PIL import Image, ImageDraw, ImageFont

from flowgrpo.rewards import Sample, SampleScore
from flowgrpo.rewards.ocr import OcrScorer

pytest.importorskip("rapidocr")
from flowgrpo.rewards.offline_ocr import RapidOcrTranscriber

WORDS = [
    "garden", "purple", "window", "rocket", "silver", "candle", "orange", "planet", "bridge", "winter",
    "forest", "island", "jacket", "marble", "pencil", "rabbit", "summer", "travel", "yellow", "zebra",
]  # fmt: skip


def render(text: str, size: int = 48) -> npt.NDArray[np.uint8]:
    """Black text on white in Pillow's built-in font (no system font needed)."""
    font = ImageFont.load_default(size=size)
    image = Image.new("RGB", (32 + size * len(text), 2 * size + 32), "white")
    ImageDraw.Draw(image).text((16, size // 2), text, fill="black", font=font)
    return np.asarray(image)


@pytest.fixture(scope="module")
def engine() -> Iterator[RapidOcrTranscriber]:
    transcriber = RapidOcrTranscriber()
    yield transcriber
    transcriber.close()


def test_reads_at_least_90_percent_of_20_rendered_words_exactly(engine: RapidOcrTranscriber) -> None:
    texts = engine.transcribe([render(word) for word in WORDS])
    exact = [t == w for t, w in zip(texts, WORDS, strict=True)]
    assert sum(exact) >= 0.9 * len(WORDS), list(zip(WORDS, texts, strict=True))


def test_ocr_reward_of_rendered_text_against_its_prompt(engine: RapidOcrTranscriber) -> None:
    image = render("Open 24 hours", size=40)
    blank = np.full((96, 256, 3), 255, np.uint8)
    outcomes = OcrScorer(engine).score(
        [Sample(image, prompt='a shop sign that says "OPEN 24 HOURS"'), Sample(blank, prompt='"hello"')]
    )
    assert outcomes == [SampleScore(1.0), SampleScore(0.0)]
