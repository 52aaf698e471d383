"""The image statistics watched for reward hacking: values against hand-computed images, and as
weight-0 scorers they add curves without changing the reward."""

from __future__ import annotations

import numpy as np
import pytest

from flowgrpo.rewards.base import Sample, SampleScore
from flowgrpo.rewards.build import build_reward
from flowgrpo.rewards.config import RewardConfig, ScorerSpec
from flowgrpo.rewards.monitor import ImageStatScorer, edge_density, luminance


def image(value: int | np.ndarray, size: int = 16) -> np.ndarray:
    out = np.zeros((size, size, 3), dtype=np.uint8)
    out[...] = value if np.ndim(value) == 0 else np.asarray(value, dtype=np.uint8)[..., None]
    return out


def test_brightness_is_the_mean_luminance() -> None:
    scorer = ImageStatScorer("image_brightness")
    scores = scorer.score([Sample(image(0), "p"), Sample(image(255), "p"), Sample(image(51), "p")])
    assert [s.value for s in scores if isinstance(s, SampleScore)] == pytest.approx([0.0, 1.0, 0.2])
    red = np.zeros((4, 4, 3), dtype=np.uint8)
    red[..., 0] = 255
    assert float(luminance(red).mean()) == pytest.approx(0.299)


def test_edge_density_counts_the_pixels_on_an_edge() -> None:
    """Flat: 0. A vertical black/white step between columns 7 and 8 of 16: the Sobel response is
    non-zero in the two interior columns next to it, every interior row: 2 of 14 columns. A
    one-pixel checkerboard: no edge by Sobel's smoothing (its 3x3 responses cancel), which is why
    the statistic is of visible structure, not of pixel noise."""
    assert edge_density(image(128)) == 0.0
    step = np.zeros((16, 16), dtype=np.uint8)
    step[:, 8:] = 255
    assert edge_density(image(step)) == pytest.approx(2 / 14)
    checker = (np.indices((16, 16)).sum(axis=0) % 2 * 255).astype(np.uint8)
    assert edge_density(image(checker)) == 0.0


def test_weight_zero_monitors_leave_the_reward_unchanged() -> None:
    samples = [Sample(image(v), "p") for v in (10, 200)]
    plain = build_reward(RewardConfig(scorers=[ScorerSpec("jpeg_compressibility", 1.0)]))
    watched = build_reward(
        RewardConfig(
            scorers=[
                ScorerSpec("jpeg_compressibility", 1.0),
                ScorerSpec("image_brightness", 0.0),
                ScorerSpec("image_edge_density", 0.0),
            ]
        )
    )
    a, b = plain.score(samples).results, watched.score(samples).results
    assert [x.reward for x in a] == [x.reward for x in b]
    assert b[0].scores["image_brightness"] == pytest.approx(10 / 255)
