"""The weighted sum of several scorers: rewards, kept scores, per-sample errors, metrics, config."""

from __future__ import annotations

import time
from collections.abc import Sequence
from pathlib import Path

import numpy as np
import pytest

from flowgrpo.config import ConfigError, load_config
from flowgrpo.rewards import (
    Outcome,
    RewardConfig,
    RewardModel,
    Sample,
    SampleError,
    SampleScore,
    Scorer,
    Weighted,
    build_reward,
    reward_metrics,
)
from flowgrpo.rewards.jpeg import JpegScorer, jpeg_kb

IMAGE = np.full((16, 16, 3), 90, np.uint8)


class Constant(Scorer):
    def __init__(
        self, name: str, value: float, fail_on: str = "", extras: dict[str, float] | None = None
    ) -> None:
        self.name, self.value, self.fail_on, self.extras = name, value, fail_on, extras or {}

    def score(self, samples: Sequence[Sample]) -> list[Outcome]:
        return [
            SampleError("unavailable", "down")
            if s.prompt == self.fail_on
            else SampleScore(self.value, self.extras)
            for s in samples
        ]


class Slow(Constant):
    def score(self, samples: Sequence[Sample]) -> list[Outcome]:
        time.sleep(0.2)
        return super().score(samples)


class Broken(Scorer):
    name = "broken"

    def score(self, samples: Sequence[Sample]) -> list[Outcome]:
        raise RuntimeError("kaput")


def test_reward_is_the_weighted_sum_and_extras_are_named_after_their_scorer() -> None:
    model = RewardModel(
        [Weighted(Slow("a", 2.0, extras={"x": 7.0}), 0.5), Weighted(Constant("b", -1.0), 3.0)]
    )
    batch = model.score([Sample(IMAGE, "p")])
    [result] = batch.results
    assert result.reward == pytest.approx(0.5 * 2.0 + 3.0 * -1.0)
    assert result.scores == {"a": 2.0, "a/x": 7.0, "b": -1.0}
    assert set(batch.seconds) == {"a", "b"}
    assert batch.seconds["a"] >= 0.2 > batch.seconds["b"]  # each scorer's own time: a sleeps 0.2 s
    assert model.weights == {"a": 0.5, "b": 3.0}


def test_a_failing_scorer_leaves_the_sample_without_reward_but_keeps_the_other_scores() -> None:
    model = RewardModel([Weighted(Constant("a", 1.0), 1.0), Weighted(Constant("b", 1.0, fail_on="bad"), 1.0)])
    good, bad = model.score([Sample(IMAGE, "good"), Sample(IMAGE, "bad")]).results
    assert good.reward == 2.0 and good.error is None
    assert bad.reward is None and bad.scores == {"a": 1.0}
    assert bad.error == SampleError("unavailable", "b: down")


def test_a_scorer_that_raises_fails_its_batch_typed_internal() -> None:
    results = RewardModel([Weighted(Broken(), 1.0)]).score([Sample(IMAGE), Sample(IMAGE)]).results
    assert all(r.reward is None and r.error is not None for r in results)
    assert results[0].error is not None and results[0].error.kind == "internal"
    assert "RuntimeError: kaput" in results[0].error.message


def test_metrics_use_the_verl_names() -> None:
    model = RewardModel([Weighted(Constant("a", 1.0, fail_on="bad", extras={"x": 2.0}), 2.0)])
    results = model.score([Sample(IMAGE, "ok"), Sample(IMAGE, "bad")]).results
    assert reward_metrics(results) == {
        "reward/errors": 1.0,
        "critic/rewards/mean": 2.0,
        "critic/rewards/max": 2.0,
        "critic/rewards/min": 2.0,
        "critic/a/mean": 1.0,
        "critic/a/x/mean": 2.0,
    }


def test_duplicate_names_and_non_finite_weights_are_refused() -> None:
    with pytest.raises(ValueError, match="unique names"):
        RewardModel([Weighted(Constant("a", 1.0), 1.0), Weighted(Constant("a", 1.0), 1.0)])
    with pytest.raises(ValueError, match="not finite"):
        RewardModel([Weighted(Constant("a", 1.0), float("nan"))])


def test_build_from_a_config_with_a_plugin_given_on_the_command_line(tmp_path: Path) -> None:
    plugin = tmp_path / "plug.py"
    plugin.write_text("def one(images, prompts, ground_truths, metadata):\n    return [1.0] * len(images)\n")
    jpeg, one = (
        "{name: jpeg_compressibility, weight: 2.0}",
        f"{{name: one, weight: 0.5, plugin: {plugin}:one}}",
    )
    override = f"scorers=[{jpeg}, {one}]"
    config = load_config(RewardConfig, None, [override])
    model = build_reward(config)
    [result] = model.score([Sample(IMAGE)]).results
    assert result.reward == pytest.approx(2.0 * -jpeg_kb(IMAGE) / 500 + 0.5)
    assert isinstance(model.parts[0].scorer, JpegScorer)


@pytest.mark.parametrize(
    ("override", "fragment"),
    [
        ("scorers=[{name: aesthetic}]", "is not built in"),
        ("scorers=[{name: ocr}, {name: ocr}]", "names must be unique"),
        ("scorers=[{name: pickscore}]", "needs reward.pickscore.model"),
        ("scorers=[]", "is empty"),
        ("scorers=[{name: a/b, plugin: x.py:f}]", "contain no '/'"),
        ("ocr.engine=tesseract", "is not one of"),
    ],
)
def test_config_errors_name_the_fix(override: str, fragment: str) -> None:
    with pytest.raises(ConfigError) as error:
        load_config(RewardConfig, None, [override])
    assert fragment in str(error.value), error.value
