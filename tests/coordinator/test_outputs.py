"""The run's outputs: progress on the terminal (a bar with the key metrics, or one line per step),
image grids, validation metrics, and what TensorBoard shows of the config and the hparams."""

from __future__ import annotations

import io
import math
from pathlib import Path

import numpy as np
import pytest
from tensorboard.plugins.hparams import api_pb2

from flowgrpo.configs.run import LoggerConfig, load_run_config
from flowgrpo.rewards.config import ScorerSpec
from flowgrpo.services.coordinator.outputs import RunOutputs, evenly_spaced, image_grid
from flowgrpo.services.coordinator.run import Group
from flowgrpo.services.coordinator.validation import validation_keys, validation_metrics
from tests.tensorboard_view import hparams_view, texts

ROOT = Path(__file__).resolve().parents[2]


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


def test_the_validation_grid_shows_prompts_spread_over_the_whole_set() -> None:
    # a task's prompts come grouped by category: the first 24 would show only the first ones
    assert evenly_spaced(list(range(114)), 24)[:4] == [0, 5, 10, 15]  # round(i * 113 / 23)
    assert evenly_spaced(list(range(114)), 24)[-1] == 113 and len(evenly_spaced(list(range(114)), 24)) == 24
    assert evenly_spaced(list(range(7)), 3) == [0, 3, 6]
    assert evenly_spaced(list(range(5)), 24) == [0, 1, 2, 3, 4] and evenly_spaced([9, 8], 1) == [9]


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


def test_validation_of_several_samples_a_prompt_logs_the_first_ones_and_all_of_them() -> None:
    groups = [
        group([{"ocr": 1.0}, {"ocr": 0.0}, {"ocr": 0.5}], [2.0, 0.0, 1.0]),
        group([{"ocr": 0.25}, {"ocr": 0.75}, {"ocr": 0.5}], [0.5, 1.5, 1.0]),
    ]
    assert validation_metrics(groups, [ScorerSpec("ocr", 2.0)], samples=3) == pytest.approx({
        "val-core/ocr/reward/mean@1": (1.0 + 0.25) / 2, "val-core/total/reward/mean@1": (2.0 + 0.5) / 2,
        "val-core/ocr/reward/mean@3": 3.0 / 6, "val-core/total/reward/mean@3": 6.0 / 6,
    })  # fmt: skip


def test_tensorboard_gets_the_config_and_an_hparams_session_with_the_last_metrics(tmp_path: Path) -> None:
    config = load_run_config(ROOT / "examples" / "tiny_jpeg.yaml", ["trainer.optim.lr=0.25"])
    keys = [*validation_keys(config.reward.scorers), "critic/rewards/mean"]
    outputs = RunOutputs(tmp_path, None)
    outputs.write_config(config, config.name, metrics=keys)
    outputs.log("val", 0, dict.fromkeys(keys[:-1], 0.1))
    outputs.log("train", 1, {"critic/rewards/mean": 0.5})
    outputs.log("val", 1, dict.fromkeys(keys[:-1], 0.2))
    outputs.end_session("success")
    outputs.close()
    logdir = tmp_path / "tensorboard"
    assert texts(logdir, "config") == [
        "".join(f"    {line}" for line in (tmp_path / "config.yaml").read_text().splitlines(keepends=True))
    ]
    experiment, groups = hparams_view(logdir)
    assert [m.name.tag for m in experiment.metric_infos] == keys
    (session,) = [s for g in groups.session_groups for s in g.sessions]
    assert session.status == api_pb2.STATUS_SUCCESS
    assert {m.name.tag: round(m.value, 6) for m in session.metric_values} == {
        **dict.fromkeys(keys[:-1], 0.2),
        "critic/rewards/mean": 0.5,
    }  # the last validation's
    shown = {
        k: v.number_value or v.string_value or v.bool_value
        for k, v in groups.session_groups[0].hparams.items()
    }
    assert shown["trainer.optim.lr"] == 0.25 and shown["schedule.mode"] == "sync"
    assert shown["reward.scorers"] == "jpeg_compressibility*1 + image_brightness*0 + image_edge_density*0"
    assert "trainer.policy.lora_rank" not in shown  # a full policy has no LoRA rank


def test_a_long_steps_note_is_a_line_in_a_log_and_the_bars_description_on_a_terminal(tmp_path: Path) -> None:
    note = "  step 2/3 (30 s): drawn 32/32, scored 12/32"
    for stream in (io.StringIO(), Terminal()):
        outputs = RunOutputs(tmp_path, stream, LoggerConfig())
        outputs.start_progress(done=1, total=3)
        outputs.note(note)
        outputs.step_done("step 2/3  reward +0.5", {"reward": "+0.5"})
        outputs.close()
        shown = stream.getvalue()
        if isinstance(stream, Terminal):  # drawn in place, then cleared when the step is done
            assert "step 2/3 (30 s): drawn 32/32, scored 12/32: " in shown and note + "\n" not in shown
            assert shown.rstrip().endswith("reward=+0.5]")
        else:
            assert shown.splitlines() == [note, "step 2/3  reward +0.5"]
