"""A request's deadline stops its compute: a rollout replica given a huge Generate with a short
deadline is free for the next call within about one denoising step of the deadline, instead of
computing for minutes an answer nobody waits for; and a request above the per-request sample
limit is refused up front. A real rollout process on a tiny BAGEL (CPU)."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Iterator

import grpc
import grpc.aio
import pytest
import torch

from flowgrpo.bus import TensorRef, serve_store
from flowgrpo.bus.torch_tensors import put_tensor
from flowgrpo.models.bagel.checkpoint import make_tiny_bagel
from flowgrpo.runtime import open_channel
from flowgrpo.sampler_params import SamplerParams
from flowgrpo.v1 import rollout_pb2, rollout_pb2_grpc

from .launch import spawn_service, stop_service

LIMIT = 1024
PARAMS = SamplerParams(num_points=6, cfg_text_scale=2.0, noise_level=1.0, window_range=(0, 2),
                       height=64, width=64, deterministic=True).to_proto()  # fmt: skip


@pytest.fixture(scope="module")
def replica(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[str, TensorRef]]:
    root = tmp_path_factory.mktemp("deadlines")
    checkpoint = make_tiny_bagel(root / "tiny", seed=0)
    overrides = [f"rollout.checkpoint={checkpoint}", f"rollout.max_request_samples={LIMIT}"]
    proc, address = spawn_service("rollout", overrides, root / "ready.json")
    try:
        with serve_store() as server:
            yield address, put_tensor(server.store, "data/p0", "prompt_ids", torch.tensor([384, 5, 6, 385]))
    finally:
        stop_service(proc)


def request(ref: TensorRef, samples: int, tag: str) -> rollout_pb2.GenerateRequest:
    group = rollout_pb2.PromptGroup(prompt_uid="p0", prompt_ids=ref.to_proto(), sample_indices=range(samples))
    return rollout_pb2.GenerateRequest(step=1, seed=0, groups=[group], params=PARAMS, release_tag=tag)


async def generate(address: str, message: rollout_pb2.GenerateRequest, timeout_s: float) -> float:
    """Seconds until the answer (or the error, raised)."""
    started = time.monotonic()
    async with open_channel(address) as channel:
        await rollout_pb2_grpc.RolloutStub(channel).Generate(message, timeout=timeout_s)
    return time.monotonic() - started


@pytest.mark.timeout(300)
def test_a_deadline_frees_the_replica_within_a_denoising_step(replica: tuple[str, TensorRef]) -> None:
    address, ref = replica
    one = min(asyncio.run(generate(address, request(ref, 1, "warm"), 60)) for _ in range(3))
    step_s = one / PARAMS.num_points  # one sample, one denoising step (an upper bound: decode too)
    with pytest.raises(grpc.aio.AioRpcError) as error:
        asyncio.run(generate(address, request(ref, LIMIT, "huge"), timeout_s=2.0))
    assert error.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED
    expired = time.monotonic()
    after = asyncio.run(generate(address, request(ref, 1, "next"), 60))
    # answered after at most the step the huge request was in, plus its own time and slack for
    # a loaded machine; the whole huge request would take LIMIT * one (minutes)
    waited = time.monotonic() - expired
    assert waited < one + step_s + 1.5, (waited, one, after)
    assert waited < LIMIT * one / 20


def test_a_request_above_the_sample_limit_is_refused(replica: tuple[str, TensorRef]) -> None:
    address, ref = replica
    with pytest.raises(grpc.aio.AioRpcError) as error:
        asyncio.run(generate(address, request(ref, LIMIT + 1, "over"), 60))
    assert error.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert f"asks for {LIMIT + 1} samples; this replica takes at most {LIMIT} per request" in str(
        error.value.details()
    )
