"""JPEG (in)compressibility on flow_grpo's scale: -(kB at quality 95) / 500."""

from __future__ import annotations

import io

import numpy as np
import pytest
from PIL import Image

from flowgrpo.rewards import Sample
from flowgrpo.rewards.base import SampleScore
from flowgrpo.rewards.jpeg import JpegScorer, jpeg_kb


def test_reward_is_minus_the_jpeg_size_in_kb_over_500() -> None:
    image = np.random.default_rng(0).integers(0, 256, (64, 96, 3), dtype=np.uint8)
    buffer = io.BytesIO()
    Image.fromarray(image).save(buffer, format="JPEG", quality=95)
    assert jpeg_kb(image) == buffer.tell() / 1000
    [compress] = JpegScorer().score([Sample(image)])
    [incompress] = JpegScorer(incompressible=True).score([Sample(image)])
    assert compress == SampleScore(-buffer.tell() / 1000 / 500)
    assert incompress == SampleScore(buffer.tell() / 1000 / 500)


def test_a_flat_image_is_more_compressible_than_noise() -> None:
    flat = np.full((64, 64, 3), 128, np.uint8)
    noise = np.random.default_rng(1).integers(0, 256, (64, 64, 3), dtype=np.uint8)
    scores = JpegScorer().score([Sample(flat), Sample(noise)])
    assert isinstance(scores[0], SampleScore) and isinstance(scores[1], SampleScore)
    assert scores[0].value > scores[1].value
    assert JpegScorer().name == "jpeg_compressibility"
    assert JpegScorer(incompressible=True).name == "jpeg_incompressibility"


def test_quality_outside_1_to_100_is_refused() -> None:
    with pytest.raises(ValueError, match=r"outside 1\.\.100"):
        JpegScorer(quality=0)
