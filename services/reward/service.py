"""The reward actor: Score (a bidirectional stream) and Info over gRPC, images from the bus.

State: the reward model (the configured scorers and their weights) and a bus client. A Score
stream runs three stages at once: requests are read as they come (up to ``read_ahead``), their
images fetched from the producers' stores in chunks of what is waiting, and the scorers take
every fetched image that is waiting when they are free (up to ``max_batch_samples``) as one
batch; each batch is one actor message, so batches of all streams run one at a time on the
compute thread, and its results go back at once, while the stream is still open.

Rewards are scalars: they return in the ScoreResults (the coordinator turns them into
advantages), not on the bus. A sample that cannot be scored comes back with a typed Error and
no reward, never a silent 0; a request whose fields are out of range (``_request_error``: the
image reference, sizes, text lengths) is such a sample, INVALID_ARGUMENT naming the field, and
the stream goes on.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass

import grpc
import grpc.aio
from google.protobuf.message import DecodeError
from opentelemetry import trace

from flowgrpo.bus import BusClient, BusError, Fetched, TensorRef
from flowgrpo.bus.refs import endpoint_problem
from flowgrpo.config_digest import role_settings
from flowgrpo.configs.reward import RewardServiceConfig
from flowgrpo.rewards import RewardModel, Sample, build_reward
from flowgrpo.rewards.combine import Batch, Scored
from flowgrpo.rewards.images import MAX_SIDE
from flowgrpo.runtime import Actor, InvalidArgument, message
from flowgrpo.services.reward.stream import Pump, take_batch
from flowgrpo.telemetry import links_from
from flowgrpo.v1 import common_pb2, reward_pb2, reward_pb2_grpc

log = logging.getLogger(__name__)
tracer = trace.get_tracer(__name__)

STAGE = common_pb2.StageSpec(stage="reward", consumes=["images"], produces=[])
ErrorCode = common_pb2.ErrorCode
MAX_IMAGE_SIDE = MAX_SIDE  # pixels: what check_image takes
MAX_TEXT_CHARS = 65536  # prompt, ground truth
MAX_ID_CHARS = 1024  # sample id, bus key, store id
MAX_METADATA = 64  # entries; keys of at most MAX_ID_CHARS, values of at most MAX_TEXT_CHARS
MAX_VERSION = 2**53  # policy versions (as the rollout and trainer take them)


@dataclass
class Pending:
    request: reward_pb2.ScoreRequest
    received: float  # perf_counter() when it arrived


@dataclass
class Ready:
    """A request whose image is here (``sample``), or could not be had (``error``)."""

    pending: Pending
    sample: Sample | None = None
    error: common_pb2.Error | None = None
    trace: dict[str, str] | None = None


class RewardService(Actor, reward_pb2_grpc.RewardServicer):
    role = "reward"

    def __init__(self, config: RewardServiceConfig, model: RewardModel | None = None) -> None:
        super().__init__(config.replica_id)
        self.config = config
        self.model: RewardModel | None = model  # built in start() unless given
        self.client = BusClient(config.bus)  # fetches images from the producers' stores
        self.stages = [STAGE]
        self.settings = role_settings(self.role, config)  # the coordinator compares them with its recipe's

    async def start(self) -> None:
        with self.startup_phase("scorers") as phase:
            if self.model is None:
                self.model = await self.compute(build_reward, self.config.reward)
            phase.detail = ", ".join(self._model().weights)
        self.labels["scorers"] = ",".join(self._model().weights)

    async def stop(self) -> None:
        self.client.close()
        if self.model is not None:
            await self.compute(self.model.close)

    # --- RPCs ----------------------------------------------------------------------------------

    @message
    async def Info(
        self, request: reward_pb2.RewardInfoRequest, context: grpc.aio.ServicerContext
    ) -> reward_pb2.RewardInfoResponse:
        weights = self._model().weights
        return reward_pb2.RewardInfoResponse(scorers=list(weights), weights=weights)

    async def Score(
        self, request_iterator: AsyncIterator[reward_pb2.ScoreRequest], context: grpc.aio.ServicerContext
    ) -> AsyncIterator[reward_pb2.ScoreResult]:
        cfg = self.config.stream
        requests = Pump(_stamped(request_iterator), cfg.read_ahead, "reward-requests")
        ready = Pump(self._fetched(requests), cfg.max_batch_samples, "reward-fetch")
        try:
            while batch := await take_batch(ready, cfg.max_batch_samples, cfg.max_wait_s):
                for result in await self._score(batch):
                    yield result
        finally:
            await ready.close()
            await requests.close()

    # --- stages --------------------------------------------------------------------------------

    async def _fetched(self, requests: Pump[Pending]) -> AsyncIterator[Ready]:
        """Images of the requests, fetched in chunks of what is waiting, as soon as they come."""
        while chunk := await take_batch(requests, self.config.stream.max_batch_samples):
            for item in await asyncio.to_thread(self._fetch, chunk):
                yield item

    def _fetch(self, chunk: list[Pending]) -> list[Ready]:
        ready = [Ready(p, error=self._request_error(p.request)) for p in chunk]
        wanted = [r for r in ready if r.error is None]
        refs = [TensorRef.from_proto(r.pending.request.image) for r in wanted]
        for item, got in zip(wanted, self.client.fetch(refs, errors="return"), strict=True):
            if isinstance(got, BusError):
                message = f"image not available on the bus: {got.message}"
                item.error = self._error(got.code.name, message, item.pending.request)
            else:
                item.sample, item.trace = _sample(item.pending.request, got), got.trace
        return ready

    @message
    async def _score(self, batch: list[Ready]) -> list[reward_pb2.ScoreResult]:
        """One message per batch: the scorers run on the compute thread, one batch at a time."""
        samples = [r.sample for r in batch if r.sample is not None]
        links = links_from(r.trace for r in batch if r.trace)
        with tracer.start_as_current_span("reward.score", links=links) as span:
            scored = await self.compute(self._model().score, samples)
            span.set_attributes({"samples": len(samples), **_seconds_by_scorer(scored, "seconds.")})
        results = iter(scored.results)
        replies = [self._result(r, next(results) if r.sample is not None else None) for r in batch]
        for reply in replies:
            reply.scorer_latency_s.update(scored.seconds)
        self._log_batch(replies, scored)
        return replies

    # --- results -------------------------------------------------------------------------------

    def _result(self, item: Ready, scored: Scored | None) -> reward_pb2.ScoreResult:
        result = reward_pb2.ScoreResult(
            sample_id=item.pending.request.sample_id,
            latency_s=time.perf_counter() - item.pending.received,
        )
        if scored is None:
            assert item.error is not None, "an unscored sample carries its fetch error"
            result.error.CopyFrom(item.error)
            return result
        result.scores.update(scored.scores)
        if scored.reward is not None:
            result.reward = scored.reward
        elif (error := scored.error) is not None:
            result.error.CopyFrom(self._error(error.kind.upper(), error.message, item.pending.request))
        return result

    def _request_error(self, request: reward_pb2.ScoreRequest) -> common_pb2.Error | None:
        """What is wrong with the request itself (checked before any fetch), or None."""
        problem = _text_problem(request)
        if problem is not None:
            return self._error("INVALID_ARGUMENT", problem, request)
        ref = request.image
        if not request.HasField("image") or not ref.key:
            message = "ScoreRequest.image: the request has no image reference"
            return self._error("INVALID_ARGUMENT", message, request)
        if ref.column != "images":
            message = f"ScoreRequest.image.column: image refers to column {ref.column[:64]!r}, not 'images'"
            return self._error("INVALID_ARGUMENT", message, request)
        if ref.dtype != "uint8" or len(ref.shape) != 3 or ref.shape[2] != 3:
            message = f"ScoreRequest.image is {ref.dtype[:64]}{list(ref.shape)[:8]}; expected uint8 [H, W, 3]"
            return self._error("SCHEMA_VIOLATION", message, request)
        problem = _ref_problem(ref)
        return None if problem is None else self._error("INVALID_ARGUMENT", problem, request)

    def _error(self, code: str, message: str, request: reward_pb2.ScoreRequest) -> common_pb2.Error:
        where = f"reward {self.replica_id} sample {request.sample_id[:200]!r} ({request.image.key[:200]})"
        return common_pb2.Error(code=ErrorCode.Value(f"ERROR_CODE_{code}"), message=message, where=where)

    def _log_batch(self, replies: list[reward_pb2.ScoreResult], scored: Batch) -> None:
        failed = sum(r.HasField("error") for r in replies)
        seconds = ", ".join(f"{name} {s * 1000:.1f} ms" for name, s in scored.seconds.items())
        log.info(
            "scored %d sample(s), %d failed: %s",
            len(replies),
            failed,
            seconds,
            extra={"samples": len(replies), "failed": failed, **_seconds_by_scorer(scored, "seconds_")},
        )

    def _model(self) -> RewardModel:
        assert self.model is not None, "the reward model is built in start(), before any message"
        return self.model


async def _stamped(requests: AsyncIterator[reward_pb2.ScoreRequest]) -> AsyncIterator[Pending]:
    """The stream's requests, stamped; one that cannot be parsed ends the stream with
    INVALID_ARGUMENT (the results sent before it stand)."""
    count = 0
    try:
        async for request in requests:
            count += 1
            yield Pending(request, time.perf_counter())
    except DecodeError as error:
        raise InvalidArgument(f"ScoreRequest {count + 1} of this stream cannot be parsed: {error}") from None


def _text_problem(request: reward_pb2.ScoreRequest) -> str | None:
    """Which text field is empty or too long (the sample id must be set), or None."""
    if not request.sample_id or len(request.sample_id) > MAX_ID_CHARS:
        return f"ScoreRequest.sample_id: need 1 to {MAX_ID_CHARS} characters, got {len(request.sample_id)}"
    for name in ("prompt", "ground_truth"):
        if len(getattr(request, name)) > MAX_TEXT_CHARS:
            return (
                f"ScoreRequest.{name}: at most {MAX_TEXT_CHARS} characters, got {len(getattr(request, name))}"
            )
    metadata = request.metadata
    too_long = [k for k, v in metadata.items() if len(k) > MAX_ID_CHARS or len(v) > MAX_TEXT_CHARS]
    if len(metadata) > MAX_METADATA or too_long:
        return (
            f"ScoreRequest.metadata: at most {MAX_METADATA} entries, keys of at most {MAX_ID_CHARS} and "
            f"values of at most {MAX_TEXT_CHARS} characters; got {len(metadata)} entries"
        )
    return None


def _ref_problem(ref: common_pb2.TensorRef) -> str | None:
    """What is wrong with an image reference of dtype uint8 [H, W, 3], or None."""
    height, width = ref.shape[0], ref.shape[1]
    if not (1 <= height <= MAX_IMAGE_SIDE and 1 <= width <= MAX_IMAGE_SIDE):
        return (
            f"ScoreRequest.image.shape={list(ref.shape)}: need [H, W, 3] with 1 <= H, W <= {MAX_IMAGE_SIDE}"
        )
    if ref.nbytes != height * width * 3:
        return f"ScoreRequest.image.nbytes={ref.nbytes}: uint8{list(ref.shape)} is {height * width * 3} bytes"
    if len(ref.key) > MAX_ID_CHARS or not ref.key.isprintable():
        return f"ScoreRequest.image.key: need 1 to {MAX_ID_CHARS} printable characters"
    if not ref.store_id or len(ref.store_id) > MAX_ID_CHARS:
        return f"ScoreRequest.image.store_id: need 1 to {MAX_ID_CHARS} characters"
    if endpoint_problem(ref.endpoint) is not None:
        return f"ScoreRequest.image.endpoint={ref.endpoint[:80]!r}: need tcp://HOST:PORT or ipc:///PATH"
    if not -1 <= ref.policy_version <= MAX_VERSION:
        version = ref.policy_version
        return f"ScoreRequest.image.policy_version={version}: need -1 <= policy_version <= {MAX_VERSION}"
    return None


def _sample(request: reward_pb2.ScoreRequest, fetched: Fetched) -> Sample:
    return Sample(
        image=fetched.array,
        prompt=request.prompt,
        ground_truth=request.ground_truth,
        metadata=dict(request.metadata),
    )


def _seconds_by_scorer(scored: Batch, prefix: str) -> dict[str, float]:
    return {prefix + name: seconds for name, seconds in scored.seconds.items()}
