"""The offline OCR reward on the task's images, per tier: rendered targets read exactly (>= 0.95
at the default 64 x 128 px), noise reads as nothing, another target's image scores near 0."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

pytest.importorskip("rapidocr")

from flowgrpo.ocr_task.measure import format_table, images, measure
from flowgrpo.ocr_task.render import RenderConfig
from flowgrpo.ocr_task.split import TEST_TIERS, TRAIN_TIERS, Target, prompt_of, split
from flowgrpo.rewards import Sample, SampleScore
from flowgrpo.rewards.build import build_reward
from flowgrpo.rewards.config import RewardConfig, ScorerSpec
from flowgrpo.rewards.offline_ocr import RapidOcrTranscriber

PER_TIER = 12


def _sample(targets: tuple[Target, ...], tiers: tuple[str, ...]) -> list[Target]:
    """PER_TIER targets of each tier, spread over the tier (every k-th)."""
    chosen = []
    for tier in tiers:
        of_tier = [t for t in targets if t.tier == tier]
        chosen += of_tier[:: max(1, len(of_tier) // PER_TIER)][:PER_TIER]
    return chosen


@pytest.fixture(scope="module")
def engine() -> Iterator[RapidOcrTranscriber]:
    transcriber = RapidOcrTranscriber()
    yield transcriber
    transcriber.close()


def test_every_tier_reads_exactly_and_noise_and_other_images_score_near_zero(
    engine: RapidOcrTranscriber,
) -> None:
    targets = _sample(split()["test"], TEST_TIERS) + _sample(split()["train"], TRAIN_TIERS)
    table = measure(engine, targets, seeds=1)
    print("\n" + format_table(table))
    for tier in (*TEST_TIERS, *TRAIN_TIERS):
        cells = table[tier]
        assert cells["rendered"].n == PER_TIER
        assert cells["rendered"].exact >= 0.95, (tier, cells["rendered"])
        assert cells["noise"].reward <= 0.02, (tier, cells["noise"])
        assert cells["mismatched"].exact == 0.0, (tier, cells["mismatched"])
    # measured 0.11 / 0.13: neighbours in the sorted lists share letters ("1" is inside "10")
    assert table["all"]["mismatched"].reward <= 0.2 and table["all"]["mismatched"].strict <= 0.2
    assert table["all"]["noise"].exact == 0.0


def test_the_configured_reward_scores_the_task_prompts(engine: RapidOcrTranscriber) -> None:
    targets = [Target("lost city", "new_pair"), Target("gold", "word"), Target("4004", "digits")]
    batch = images(targets, seed=4, config=RenderConfig())
    config = RewardConfig(scorers=[ScorerSpec("ocr")])
    config.ocr.engine, config.ocr.rule = "offline", "strict"
    reward = build_reward(config)
    try:
        scorer = reward.parts[0].scorer
        own = [
            Sample(image, prompt=prompt_of(t.text, i))
            for i, (t, image) in enumerate(zip(targets, batch["rendered"], strict=True))
        ]
        assert scorer.score(own) == [SampleScore(1.0)] * 3
        # "gold" against the image of "lost city": strict 1 - lev("gold", "lostcity") / 8
        swapped = scorer.score([Sample(batch["rendered"][0], prompt=prompt_of("gold"))])
        assert swapped == [SampleScore(1 - 7 / 8)]
    finally:
        for part in reward.parts:
            part.scorer.close()
