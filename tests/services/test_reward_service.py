"""The reward service as a real process: images put on a bus store by this test, scored over a
bidirectional gRPC stream (results arrive while the stream is still open), JPEG compressibility
plus a plug-in, weights summed, typed per-sample errors, and a clean SIGTERM drain."""

from __future__ import annotations

import asyncio
import subprocess
import textwrap
import time
from collections.abc import AsyncIterator, Iterator, Sequence
from dataclasses import dataclass

import grpc
import numpy as np
import pytest

from flowgrpo.bus import BusServer, TensorRef, serve_store
from flowgrpo.configs.reward import RewardServiceConfig, StreamConfig
from flowgrpo.rewards import Outcome, RewardModel, Sample, SampleScore, Scorer, Weighted
from flowgrpo.rewards.jpeg import JpegScorer
from flowgrpo.rewards.plugins import PluginScorer
from flowgrpo.runtime import Service, ServiceServer, open_channel
from flowgrpo.services.reward.service import RewardService
from flowgrpo.services.reward.stream import Pump, take_batch
from flowgrpo.v1 import common_pb2, reward_pb2, reward_pb2_grpc

from .launch import spawn_service, stop_service

PLUGIN = """
    def brightness(images, prompts, ground_truths, metadata):
        for m in metadata:
            if m.get("explode"):
                raise ValueError("refusing " + m["explode"])
        return [float(i.mean()) / 255 for i in images], {"height": [float(i.shape[0]) for i in images]}
"""
WEIGHTS = {"jpeg_compressibility": 1.0, "bright": 2.0}


@dataclass
class Reward:
    address: str
    plugin: str
    proc: subprocess.Popen[str]


@pytest.fixture(scope="module")
def reward(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Reward]:
    root = tmp_path_factory.mktemp("reward")
    plugin = root / "plug.py"
    plugin.write_text(textwrap.dedent(PLUGIN))
    target = f"{plugin}:brightness"
    scorers = (
        f"[{{name: jpeg_compressibility, weight: 1.0}}, {{name: bright, weight: 2.0, plugin: {target}}}]"
    )
    overrides = [f"reward.scorers={scorers}", "stream.max_batch_samples=4"]
    proc, address = spawn_service("reward", overrides, root / "ready.json")
    try:
        yield Reward(address, target, proc)
    finally:
        stop_service(proc)


@pytest.fixture(scope="module")
def store() -> Iterator[BusServer]:
    with serve_store() as server:
        yield server


def image(seed: int, height: int = 48) -> np.ndarray:
    rng = np.random.default_rng(seed)
    smooth = np.linspace(0, 255, 64, dtype=np.float32)[None, :, None] * rng.uniform(0.2, 1.0)
    noise = rng.normal(0, 20 * seed, (height, 64, 3))
    return np.clip(smooth + noise, 0, 255).astype(np.uint8)


def request(sample_id: str, ref: TensorRef, **metadata: str) -> reward_pb2.ScoreRequest:
    return reward_pb2.ScoreRequest(sample_id=sample_id, image=ref.to_proto(), prompt="a picture",
                                   metadata=metadata)  # fmt: skip


def expected_reward(array: np.ndarray, target: str) -> tuple[float, dict[str, float]]:
    [jpeg] = JpegScorer().score([Sample(array)])
    [bright] = PluginScorer.load("bright", target).score([Sample(array, prompt="a picture")])
    assert isinstance(jpeg, SampleScore) and isinstance(bright, SampleScore)
    scores = {
        "jpeg_compressibility": jpeg.value,
        "bright": bright.value,
        "bright/height": bright.extras["height"],
    }
    return WEIGHTS["jpeg_compressibility"] * jpeg.value + WEIGHTS["bright"] * bright.value, scores


async def stream_one_then_rest(
    address: str, first: reward_pb2.ScoreRequest, rest: list[reward_pb2.ScoreRequest]
) -> tuple[reward_pb2.ScoreResult, list[reward_pb2.ScoreResult]]:
    """Send one request and read its result while the stream stays open; then send the rest."""
    outbox: asyncio.Queue[reward_pb2.ScoreRequest | None] = asyncio.Queue()

    async def requests():  # type: ignore[no-untyped-def]
        while (item := await outbox.get()) is not None:
            yield item

    async with open_channel(address) as channel:
        call = reward_pb2_grpc.RewardStub(channel).Score(requests(), timeout=60)
        await outbox.put(first)
        head = await asyncio.wait_for(call.read(), 30)  # the stream is still open here
        for item in [*rest, None]:
            await outbox.put(item)
        tail = []
        while (result := await call.read()) is not grpc.aio.EOF:
            tail.append(result)
    return head, tail


def test_scores_stream_back_before_the_stream_closes_with_weights_summed(
    reward: Reward, store: BusServer
) -> None:
    arrays = {f"p{i}/0": image(i, height=48 + 16 * (i % 2)) for i in range(9)}
    refs = {sid: store.store.put(f"s1/{sid}/images", "images", a) for sid, a in arrays.items()}
    ids = list(arrays)
    head, tail = asyncio.run(stream_one_then_rest(
        reward.address, request(ids[0], refs[ids[0]]), [request(i, refs[i]) for i in ids[1:]]))  # fmt: skip
    results = {r.sample_id: r for r in [head, *tail]}
    assert head.sample_id == ids[0] and sorted(results) == sorted(ids)
    for sid, array in arrays.items():
        result = results[sid]
        assert not result.HasField("error"), result.error
        value, scores = expected_reward(array, reward.plugin)
        assert result.reward == pytest.approx(value, rel=1e-12)
        assert dict(result.scores) == pytest.approx(scores, rel=1e-12)
        assert set(result.scorer_latency_s) == set(scores) - {k for k in scores if "/" in k}
        # from arrival to reply: it contains its batch's scorers, which run one after the other
        assert result.latency_s >= sum(result.scorer_latency_s.values()), result
    assert len({round(r.reward, 6) for r in results.values()}) == len(ids), (
        "distinct images, distinct rewards"
    )


def test_bad_samples_fail_typed_and_the_stream_goes_on(reward: Reward, store: BusServer) -> None:
    good = store.store.put("s2/good/images", "images", image(1))
    weights = store.store.put("s2/w", "weights", np.zeros((4, 4), np.float32))
    missing = TensorRef(
        good.endpoint, "s2/nope/images", "images", "uint8", (48, 64, 3), good.nbytes, good.store_id
    )
    requests = [
        request("missing", missing),
        request("column", weights),
        request("explode", good, explode="this one"),
        reward_pb2.ScoreRequest(sample_id="noref"),
        request("good", good),
    ]
    head, tail = asyncio.run(stream_one_then_rest(reward.address, requests[0], requests[1:]))
    results = {r.sample_id: r for r in [head, *tail]}
    codes = {
        sid: common_pb2.ErrorCode.Name(r.error.code) for sid, r in results.items() if r.HasField("error")
    }
    assert codes == {
        "missing": "ERROR_CODE_NOT_FOUND",
        "column": "ERROR_CODE_INVALID_ARGUMENT",
        "explode": "ERROR_CODE_INTERNAL",
        "noref": "ERROR_CODE_INVALID_ARGUMENT",
    }
    assert "raised ValueError: refusing this one" in results["explode"].error.message
    assert "jpeg_compressibility" in results["explode"].scores, "the scores that worked are kept"
    assert "column 'weights'" in results["column"].error.message
    assert "'missing'" in results["missing"].error.where
    assert results["good"].reward == pytest.approx(expected_reward(image(1), reward.plugin)[0], rel=1e-12)


def test_info_names_the_scorers_and_weights(reward: Reward) -> None:
    async def info() -> reward_pb2.RewardInfoResponse:
        async with open_channel(reward.address) as channel:
            return await reward_pb2_grpc.RewardStub(channel).Info(reward_pb2.RewardInfoRequest(), timeout=30)

    response = asyncio.run(info())
    assert list(response.scorers) == list(WEIGHTS) and dict(response.weights) == WEIGHTS


# --- in process: batching of what is waiting, and the stream plumbing -----------------------------


class SlowCounter(Scorer):
    """Records batch sizes; slow enough that requests pile up while it works."""

    name = "slow"

    def __init__(self) -> None:
        self.sizes: list[int] = []

    def score(self, samples: Sequence[Sample]) -> list[Outcome]:
        self.sizes.append(len(samples))
        time.sleep(0.2)
        return [SampleScore(float(s.image[0, 0, 0])) for s in samples]


def test_the_scorers_take_every_waiting_image_as_one_batch(store: BusServer) -> None:
    refs = [store.store.put(f"s3/p{i}/images", "images", np.full((8, 8, 3), i, np.uint8)) for i in range(9)]
    scorer = SlowCounter()
    config = RewardServiceConfig(stream=StreamConfig(max_batch_samples=4))
    actor = RewardService(config, model=RewardModel([Weighted(scorer, 1.0)]))

    async def scenario() -> list[reward_pb2.ScoreResult]:
        service = Service("flowgrpo.v1.Reward", actor, reward_pb2_grpc.add_RewardServicer_to_server)
        server = ServiceServer(actor, config.server, [service])
        address = await server.start()
        try:
            requests = [request(f"p{i}", ref) for i, ref in enumerate(refs)]
            _, tail = await stream_one_then_rest(address, requests[0], requests[1:])
            return tail
        finally:
            await server.stop()

    tail = asyncio.run(scenario())
    assert sorted(r.reward for r in tail) == [float(i) for i in range(1, 9)]
    assert scorer.sizes[0] == 1 and sum(scorer.sizes) == 9
    assert max(scorer.sizes) == 4 and len(scorer.sizes) <= 5, scorer.sizes


def test_a_pump_hands_over_items_then_the_source_error() -> None:
    async def source() -> AsyncIterator[int]:
        for i in range(5):
            yield i
        raise ValueError("source broke")

    async def scenario() -> list[list[int]]:
        pump = Pump(source(), depth=8)
        await asyncio.sleep(0.01)  # all five items are waiting
        batches = [await take_batch(pump, 3), await take_batch(pump, 3)]
        with pytest.raises(ValueError, match="source broke"):
            await take_batch(pump, 3)
        await pump.close()
        return batches

    assert asyncio.run(scenario()) == [[0, 1, 2], [3, 4]]


def test_take_batch_waits_max_wait_for_more() -> None:
    async def source() -> AsyncIterator[int]:
        for i in range(3):
            yield i
            await asyncio.sleep(0.05)

    async def scenario() -> tuple[list[int], list[int], list[int]]:
        pump = Pump(source(), depth=8)
        first = await take_batch(pump, 8)  # only what is there: the first item
        rest = await take_batch(pump, 8, max_wait_s=1.0)  # waits for the others and the end
        end = await take_batch(pump, 8)
        await pump.close()
        return first, rest, end

    assert asyncio.run(scenario()) == ([0], [1, 2], [])
