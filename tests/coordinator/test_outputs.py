"""The run's progress on the terminal: a bar with the key metrics, or one line per step."""

from __future__ import annotations

import io
import math
from pathlib import Path

import numpy as np
import pytest

from flowgrpo.rewards.config import ScorerSpec
from flowgrpo.services.coordinator.config import LoggerConfig
from flowgrpo.services.coordinator.outputs import RunOutputs, image_grid
from flowgrpo.services.coordinator.run import Group, validation_metrics


def progress(tmp_path: Path, mode: str, stream: io.StringIO) -> str:
    outputs = RunOutputs(tmp_path, stream, LoggerConfig(progress=mode))  # type: ignore[arg-type]
    outputs.start_progress(done=1, total=3)  # resumed after step 1
    for step in (2, 3):
        outputs.step_done(f"step {step}/3  reward +0.5", {"reward": f"+0.{step}", "lag": "0"})
    outputs.say("  validation: val-core/x/reward/mean@1 +0.9")
    outputs.close()
    return stream.getvalue()


class Terminal(io.StringIO):
    def isatty(self) -> bool:
        return True


def test_a_terminal_gets_a_bar_with_the_key_metrics(tmp_path: Path) -> None:
    shown = progress(tmp_path, "auto", Terminal())
    assert "3/3" in shown and "reward=+0.3" in shown and "lag=0" in shown
    assert "  validation: val-core/x/reward/mean@1 +0.9" in shown  # printed above the bar
    assert "step 2/3" not in shown


def test_a_log_file_gets_one_line_per_step(tmp_path: Path) -> None:
    shown = progress(tmp_path, "auto", io.StringIO())
    assert shown.splitlines() == ["step 2/3  reward +0.5", "step 3/3  reward +0.5",
                                  "  validation: val-core/x/reward/mean@1 +0.9"]  # fmt: skip
    assert progress(tmp_path, "bar", io.StringIO()).count("reward=+0.") >= 2  # asked for: a bar anyway
    assert progress(tmp_path, "none", Terminal()) == ""


def test_a_grid_shows_small_images_enlarged_pixel_for_pixel() -> None:
    rng = np.random.default_rng(0)
    images = [rng.integers(0, 256, (64, 48, 3), dtype=np.uint8) for _ in range(5)]
    grid = image_grid(images, columns=4, cell_px=256)
    assert grid.shape == (2 * 256, 4 * 192, 3)  # factor 4 (the longer side 64 -> 256), 2 rows
    assert np.array_equal(grid[:256:4, 192:384:4], images[1])  # every 4th pixel: the image itself
    assert np.array_equal(grid[256:, 192:], np.zeros((256, 3 * 192, 3), np.uint8))  # padding
    big = [rng.integers(0, 256, (512, 512, 3), dtype=np.uint8)]
    assert np.array_equal(image_grid(big, cell_px=256), big[0])  # never shrunk


def group(scores: list[dict[str, float]], rewards: list[float]) -> Group:
    return Group(row=None, ids_ref=None, scores=scores, rewards=rewards)  # type: ignore[arg-type]


def test_validation_is_keyed_by_scorer_with_the_weighted_total_when_it_differs() -> None:
    groups = [
        group([{"ocr": 0.5, "ocr/cer": 0.25, "jpeg": -2.0}], [0.5 * 2 - 2.0 * 0.1]),
        group([{"ocr": 1.0, "ocr/cer": 0.0, "jpeg": -4.0}], [1.0 * 2 - 4.0 * 0.1]),
        group([], []),  # a group whose reward failed: left out, not counted as 0
    ]
    scorers = [ScorerSpec("ocr", 2.0), ScorerSpec("jpeg", 0.1)]
    assert validation_metrics(groups, scorers) == pytest.approx({
        "val-core/jpeg/reward/mean@1": -3.0, "val-core/ocr/reward/mean@1": 0.75,
        "val-aux/ocr/cer/mean@1": 0.125, "val-core/total/reward/mean@1": (0.8 + 1.6) / 2,
    })  # fmt: skip
    one = validation_metrics(groups[:1], [ScorerSpec("ocr", 1.0)])
    assert "val-core/total/reward/mean@1" not in one  # the total is the one scorer's score
    missing = validation_metrics([group([], [])], [ScorerSpec("ocr", 1.0)])
    assert math.isnan(missing["val-core/ocr/reward/mean@1"])  # a gap in the curve, not a zero
