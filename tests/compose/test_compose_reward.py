"""The compose reward: rendered images score 1, wrong ones less, a bad ground truth fails its
own sample only; extras are means over the samples they apply to; and the real reward service
scores it over gRPC from images on the bus."""

from __future__ import annotations

import asyncio

import numpy as np
import pytest

from flowgrpo.bus import serve_store
from flowgrpo.compose.grammar import Counting, Position, Relation, Single, Spec, prompt_of
from flowgrpo.compose.render import render
from flowgrpo.config import ConfigError, load_config
from flowgrpo.configs.reward import RewardServiceConfig
from flowgrpo.rewards import RewardConfig, Sample, SampleError, SampleScore, ScorerSpec, build_reward
from flowgrpo.rewards.combine import reward_metrics
from flowgrpo.rewards.compose import ComposeScorer
from flowgrpo.runtime import Service, ServiceServer, open_channel
from flowgrpo.services.reward.service import RewardService
from flowgrpo.v1 import common_pb2, reward_pb2, reward_pb2_grpc

LEFT_OF = Relation("red", "left of", "blue")
RIGHT_OF = Relation("red", "right of", "blue")


def _sample(truth: Spec, drawn: Spec, seed: int = 0) -> Sample:
    return Sample(render(drawn, np.random.default_rng(seed)), ground_truth=prompt_of(truth))


def _scores(outcomes: list[object]) -> list[SampleScore]:
    assert all(isinstance(o, SampleScore) for o in outcomes), outcomes
    return outcomes  # type: ignore[return-value]


def test_own_images_score_one_and_wrong_ones_less() -> None:
    samples = [_sample(LEFT_OF, LEFT_OF), _sample(LEFT_OF, RIGHT_OF), _sample(Single("red"), Single("green"))]
    partial = _scores(ComposeScorer("partial").score(samples))
    strict = _scores(ComposeScorer("strict").score(samples))
    # present red, present blue, relation, nothing else: 3 of 4 for the mirrored image;
    # present red, nothing else: 0 of 2 for a green blob
    assert [s.value for s in partial] == [1.0, 0.75, 0.0]
    assert [s.value for s in strict] == [1.0, 0.0, 0.0]
    verdict_extras = {k: v for k, v in partial[1].extras.items() if not k.startswith("scene/")}
    assert verdict_extras == {
        "accuracy": 0.0,
        "accuracy/relation": 0.0,
        "met/present": 1.0,
        "met/relation": 0.0,
        "met/nothing_else": 1.0,
    }
    assert strict[0].extras == {**partial[0].extras} and partial[0].extras["accuracy/relation"] == 1.0


def test_scene_stats_say_what_an_image_holds_whatever_was_asked() -> None:
    """The monitor's extras: four red blobs drawn for "two red blobs" are 4 blobs, 2 extra, of
    the counting renderer's 9-14 px (through anti-aliasing: 8-15 px of 64); an empty image none."""
    four = _sample(Counting("red", 2), Counting("red", 4), seed=3)
    empty = Sample(np.full((64, 64, 3), 51, np.uint8), ground_truth="a red blob")
    drawn, blank = _scores(ComposeScorer("partial").score([four, empty]))
    assert drawn.value < 1.0 and drawn.extras["met/count"] == 0.0
    assert drawn.extras["scene/blobs"] == 4.0 and drawn.extras["scene/extra_blobs"] == 2.0
    assert 8 / 64 <= drawn.extras["scene/blob_diameter"] <= 15 / 64
    assert drawn.extras["scene/regions"] == 0.0 and drawn.extras["scene/clutter"] <= 0.03
    assert {k: v for k, v in blank.extras.items() if k.startswith("scene/")} == {
        "scene/blobs": 0.0, "scene/extra_blobs": 0.0, "scene/blob_diameter": 0.0,
        "scene/clutter": 0.0, "scene/regions": 0.0,
    }  # fmt: skip


def test_a_bad_ground_truth_fails_its_own_sample_only() -> None:
    good = _sample(Single("red"), Single("red"))
    bad = Sample(good.image, ground_truth="a red square")
    none = Sample(good.image)
    from_prompt = Sample(good.image, prompt="a red blob")  # no ground truth: the prompt is read
    huge = Sample(np.full((1100, 64, 3), 128, np.uint8), ground_truth="a red blob")
    outcomes = ComposeScorer().score([good, bad, none, from_prompt, huge])
    assert isinstance(outcomes[0], SampleScore) and outcomes[0].value == 1.0
    assert isinstance(outcomes[3], SampleScore) and outcomes[3].value == 1.0
    for outcome, words in zip(
        outcomes[1:3] + outcomes[4:],
        ["ground truth 'a red square' is not a compose prompt: word 3, 'square': expected 'blob'",
         "the ground truth and the prompt are empty", "sides of 16 to 1024 pixels"],
        strict=True,
    ):  # fmt: skip
        assert isinstance(outcome, SampleError) and outcome.kind == "invalid_argument", outcome
        assert words in outcome.message, outcome.message


def test_the_builder_makes_it_from_the_recipe_and_metrics_average_per_category() -> None:
    config = RewardConfig(scorers=[ScorerSpec("compose")])
    config.compose.score = "strict"
    model = build_reward(config)
    samples = [
        _sample(LEFT_OF, LEFT_OF, 1),
        _sample(LEFT_OF, RIGHT_OF, 2),
        _sample(Counting("green", 3), Counting("green", 3), 3),
        _sample(Position("white", "top"), Position("white", "top"), 4),
    ]
    results = model.score(samples).results
    assert [r.reward for r in results] == [1.0, 0.0, 1.0, 1.0]
    metrics = reward_metrics(results)
    assert metrics["critic/compose/accuracy/mean"] == 0.75
    assert metrics["critic/compose/accuracy/relation/mean"] == 0.5  # of the two relation samples
    assert metrics["critic/compose/accuracy/counting/mean"] == 1.0
    assert metrics["critic/compose/met/relation/mean"] == 0.5
    assert metrics["critic/compose/met/count/mean"] == 1.0  # only the counting sample has one


def test_the_score_mode_is_checked_where_the_config_is_read() -> None:
    config = load_config(RewardServiceConfig, overrides=["reward.scorers=[{name: compose}]"])
    assert config.reward.compose.score == "partial"
    with pytest.raises(ConfigError, match=r"reward\.compose\.score"):
        load_config(RewardServiceConfig, overrides=["reward.compose.score=mostly"])
    with pytest.raises(ValueError, match="compose score 'mostly'"):
        ComposeScorer("mostly")  # type: ignore[arg-type]


def test_the_reward_service_scores_compose_images_over_grpc() -> None:
    config = load_config(RewardServiceConfig, overrides=["reward.scorers=[{name: compose, weight: 2.0}]"])
    drawn = {"ok": LEFT_OF, "mirrored": RIGHT_OF, "bad-truth": LEFT_OF}

    async def scenario(store: object) -> dict[str, reward_pb2.ScoreResult]:
        actor = RewardService(config)  # the model is built from the config at start
        service = Service("flowgrpo.v1.Reward", actor, reward_pb2_grpc.add_RewardServicer_to_server)
        server = ServiceServer(actor, config.server, [service])
        address = await server.start()
        try:
            requests = []
            for sid, spec in drawn.items():
                image = render(spec, np.random.default_rng(5))
                ref = store.store.put(f"c/{sid}/images", "images", image)  # type: ignore[attr-defined]
                truth = "a red blob left of a blue blob" if sid == "bad-truth" else prompt_of(LEFT_OF)
                requests.append(
                    reward_pb2.ScoreRequest(sample_id=sid, image=ref.to_proto(), ground_truth=truth)
                )
            async with open_channel(address) as channel:
                call = reward_pb2_grpc.RewardStub(channel).Score(iter(requests), timeout=60)
                return {r.sample_id: r async for r in call}
        finally:
            await server.stop()

    with serve_store() as store:
        results = asyncio.run(scenario(store))
    assert results["ok"].reward == 2.0 and results["ok"].scores["compose/accuracy"] == 1.0
    assert results["mirrored"].reward == 2.0 * 0.75 and results["mirrored"].scores["compose/accuracy"] == 0.0
    error = results["bad-truth"].error
    assert common_pb2.ErrorCode.Name(error.code) == "ERROR_CODE_INVALID_ARGUMENT"
    assert "word 4, 'left': expected" in error.message and "'bad-truth'" in error.where
    assert results["bad-truth"].reward == 0.0 and not results["bad-truth"].scores  # no score, the error


def test_a_run_recipe_takes_the_compose_prompts_and_reward() -> None:
    from flowgrpo.configs.run import RunConfig

    overrides = [
        "data.prompts=examples/data/compose",
        "data.kind=compose",
        "reward.scorers=[{name: compose}]",
        "reward.compose.score=strict",
    ]
    config = load_config(RunConfig, overrides=overrides)
    assert config.data.kind == "compose" and config.reward.compose.score == "strict"
