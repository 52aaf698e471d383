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


# --- the settings for RL on small images (issue #62) ------------------------------------------

from flowgrpo.ocr_task.render import RenderConfig  # noqa: E402
from flowgrpo.ocr_task.render import render as render_task  # noqa: E402
from flowgrpo.rewards.ocr import normalize  # noqa: E402
from flowgrpo.rewards.offline_ocr import OfflineOcrConfig, text_band  # noqa: E402

BLUR_SIGMA = 3.0  # px; measured at 64 x 128: the detector misses about half the words, the band reads them


def blur(image: npt.NDArray[np.uint8], sigma: float) -> npt.NDArray[np.uint8]:
    import cv2  # rapidocr's dependency

    return np.asarray(cv2.GaussianBlur(image, (0, 0), sigma), np.uint8)


def test_the_orientation_classifier_is_off_by_default_and_never_loaded(engine: RapidOcrTranscriber) -> None:
    image = render_task("gold", np.random.default_rng(0))
    assert engine.read(image).text == "gold"
    assert engine.engine.cfg.Global.use_cls is False and engine.engine.use_cls is False
    assert engine.engine.text_cls is None, "rapidocr loads its classifier on first use: it was used"
    with_cls = RapidOcrTranscriber(OfflineOcrConfig(use_cls=True, rec_fallback=False))
    with_cls.read(image)
    assert with_cls.engine.text_cls is not None, "use_cls=True runs the classifier"


WORDS_64 = ["gold", "lost city", "burger", "2024", "zone", "fresh hope", "water", "mars", "diamond",
            "open daily", "exit", "summer", "jousted", "near", "forever", "sale now", "floor", "best zone",
            "yours", "ahead", "inside", "city", "free", "hope"]  # fmt: skip


def test_the_text_band_recovers_blurred_words_the_detector_misses(engine: RapidOcrTranscriber) -> None:
    rng = np.random.default_rng(1)
    images = [blur(render_task(w, rng), BLUR_SIGMA) for w in WORDS_64]
    readings = [engine.read(image) for image in images]
    by_band = [i for i, r in enumerate(readings) if r.path == "band"]
    exact = [normalize(r.text) == normalize(w) for r, w in zip(readings, WORDS_64, strict=True)]
    band_exact = sum(exact[i] for i in by_band)
    print(f"\nblur {BLUR_SIGMA}: {len(by_band)}/{len(WORDS_64)} missed by the detector, {band_exact} of "
          f"them read exactly from the band; {sum(exact)}/{len(WORDS_64)} exact in all")  # fmt: skip
    assert len(by_band) >= 6, readings  # the detector misses a good share: the case exists
    assert band_exact >= 0.9 * len(by_band), [(WORDS_64[i], readings[i].text) for i in by_band]
    assert sum(exact) >= 0.9 * len(WORDS_64)
    detector_only = RapidOcrTranscriber(OfflineOcrConfig(rec_fallback=False))
    assert detector_only.recognizer is None
    assert [detector_only.read(images[i]).text for i in by_band] == [""] * len(by_band)


def test_noise_and_blank_images_read_as_nothing(engine: RapidOcrTranscriber) -> None:
    rng = np.random.default_rng(2)
    noise = [rng.integers(0, 256, (64, 128, 3), dtype=np.uint8) for _ in range(12)]
    readings = [engine.read(image) for image in noise]
    assert sum(len(normalize(r.text)) for r in readings) <= 2, readings
    for grey in (0, 128, 255):
        blank = np.full((64, 128, 3), grey, np.uint8)
        assert engine.read(blank) == engine.read(blank) == type(readings[0])("", "none")
    smooth = blur(noise[0], 8.0)  # a smooth random field: no text, deviations everywhere
    assert len(normalize(engine.read(smooth).text)) <= 1


def test_the_text_band_is_the_ink_with_half_its_height_around_it() -> None:
    image = np.full((64, 128, 3), 200, np.uint8)
    image[20:30, 40:80] = 30  # ink: rows 20-29, columns 40-79, band height 10 -> margin 5
    band = text_band(image)
    assert band is not None and band.shape == (20, 50, 3)  # rows 15-34, columns 35-84
    assert (band[5:15, 5:45] == 30).all() and (band[:5] == 200).all()
    image[20:30, 40:80] = 190  # 10 from the background: below BAND_MIN_DEVIATION, not ink
    assert text_band(image) is None
    assert text_band(np.full((64, 128, 3), 7, np.uint8)) is None


def test_the_pool_reads_what_one_thread_reads_and_its_time_per_image() -> None:
    from flowgrpo.ocr_task.measure import time_per_image

    baseline = RapidOcrTranscriber(OfflineOcrConfig(workers=1, threads=1))
    pooled = RapidOcrTranscriber(OfflineOcrConfig(workers=2, threads=1))
    try:
        rng = np.random.default_rng(3)
        for height in (64, 128, 256):
            config = RenderConfig(height=height, width=2 * height)
            batch = [render_task(w, rng, config) for w in WORDS_64[:8]]
            assert pooled.transcribe(batch) == baseline.transcribe(batch) == [*WORDS_64[:8]]
            one, two = time_per_image(baseline, batch), time_per_image(pooled, batch)
            print(f"\n{height} x {2 * height} px: {1000 * one:.1f} ms/image on one thread, "
                  f"{1000 * two:.1f} with 2 workers")  # fmt: skip
    finally:
        baseline.close()
        pooled.close()
    assert pooled._pool is None, "close() shuts the pool down"


def test_the_settings_are_checked() -> None:
    with pytest.raises(ValueError, match=r"offline\.workers 0 must be >= 1"):
        OfflineOcrConfig(workers=0).validate()
    assert OfflineOcrConfig().intra_op_threads() == 0  # one worker: onnxruntime's default
    assert OfflineOcrConfig(workers=2, threads=3).intra_op_threads() == 3
    import os

    assert OfflineOcrConfig(workers=2).intra_op_threads() == max(1, (os.cpu_count() or 1) // 2)
