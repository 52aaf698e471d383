"""Images that are not uint8 [H, W, 3] are refused with a message naming the problem and the fix."""

from __future__ import annotations

import numpy as np
import pytest

from flowgrpo.rewards import ImageError, RewardModel, Sample, Weighted, check_image
from flowgrpo.rewards.jpeg import JpegScorer


def test_a_uint8_hwc_image_passes_and_comes_back_contiguous() -> None:
    image = np.zeros((8, 12, 3), np.uint8)[:, ::2]
    checked = check_image(image)
    assert checked.shape == (8, 6, 3) and checked.flags.c_contiguous


@pytest.mark.parametrize(
    ("image", "fragment"),
    [
        (np.zeros((8, 8, 3), np.float32), "dtype float32 is not uint8"),
        (np.full((8, 8, 3), np.nan, np.float32), "192 NaN or infinite value(s)"),
        (np.zeros((8, 8, 3), np.int64), "dtype int64 is not uint8"),
        (np.zeros((3, 8, 8), np.uint8), "channels first? transpose to HWC"),
        (np.zeros((8, 8), np.uint8), "shape [8, 8] is not [H, W, 3]"),
        (np.zeros((8, 8, 4), np.uint8), "shape [8, 8, 4] is not [H, W, 3]"),
        (np.zeros((0, 8, 3), np.uint8), "empty image"),
        (np.zeros((8193, 1, 3), np.uint8), "8193 x 1 pixels; at most 8192 a side"),
        (
            np.broadcast_to(np.float32(np.nan), (1, 100_000, 3)),
            "1 x 100000 pixels; at most 8192",
        ),  # not scanned
        ([[1, 2, 3]], "expected a numpy array"),
    ],
)
def test_bad_images_are_rejected_clearly(image: object, fragment: str) -> None:
    with pytest.raises(ImageError) as error:
        check_image(image, where="sample 7")
    assert fragment in str(error.value) and str(error.value).startswith("sample 7:"), error.value


def test_a_bad_image_fails_its_own_sample_before_any_scorer_sees_it() -> None:
    model = RewardModel([Weighted(JpegScorer(), 1.0)])
    good = np.full((16, 16, 3), 200, np.uint8)
    nan = np.full((16, 16, 3), np.nan, np.float32)
    results = model.score([Sample(good), Sample(nan), Sample(good)]).results
    assert results[0].reward is not None and results[2].reward is not None
    assert results[1].reward is None and results[1].error is not None
    assert results[1].error.kind == "invalid_argument" and "NaN" in results[1].error.message
    assert "image:" in results[1].error.message
