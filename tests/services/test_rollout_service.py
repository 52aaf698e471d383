"""The rollout service as a real process: prompt ids in from a bus store, trajectories out on the
bus, policy updates between requests, release on command. Compared bitwise with the same engine
run in this process (deterministic mode, CPU fp32)."""

from __future__ import annotations

import asyncio
import subprocess
from collections.abc import Iterator
from dataclasses import dataclass, replace
from pathlib import Path

import grpc
import grpc.aio
import pytest
import torch

from flowgrpo.bus import BusClient, BusServer, Released, TensorRef, serve_store
from flowgrpo.bus.torch_tensors import put_tensor, to_torch
from flowgrpo.models.bagel.checkpoint import make_tiny_bagel
from flowgrpo.models.bagel.policy import PolicyUpdate
from flowgrpo.models.bagel.sampling import SampleRequest
from flowgrpo.runtime import open_channel
from flowgrpo.sampler_params import SamplerParams
from flowgrpo.services.rollout.engine import NativeBagelEngine
from flowgrpo.v1 import common_pb2, rollout_pb2, rollout_pb2_grpc

from .launch import spawn_service, stop_service

PARAMS = SamplerParams(num_points=7, height=32, width=48, window_size=2, window_range=(0, 4),
                       deterministic=True)  # fmt: skip
WIRE_PARAMS = common_pb2.SamplerParams(
    num_points=7, timestep_shift=3.0, cfg_text_scale=4.0, cfg_img_scale=1.0, cfg_interval_lo=0.0,
    cfg_interval_hi=1.0, cfg_renorm_type="global", cfg_renorm_min=0.0, sde_type="sde", noise_level=1.3,
    window_size=2, window_range_lo=0, window_range_hi=4, window_strategy="random", height=32, width=48,
    deterministic=True, decode_images=True,
)  # fmt: skip
PROMPTS = {"p0": [384, 5, 6, 7, 385], "p1": [384, 9, 385], "p2": [384, 1, 2, 3, 4, 5, 6, 385]}
INVALID, PRECONDITION = grpc.StatusCode.INVALID_ARGUMENT, grpc.StatusCode.FAILED_PRECONDITION
Q = "language_model.model.layers.0.self_attn.q_proj_moe_gen"


@dataclass
class Rollout:
    address: str
    checkpoint: Path
    proc: subprocess.Popen[str]


@pytest.fixture(scope="module")
def rollout(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Rollout]:
    root = tmp_path_factory.mktemp("rollout")
    checkpoint = make_tiny_bagel(root / "tiny", seed=0)
    overrides = [f"rollout.checkpoint={checkpoint}", "rollout.max_batch_samples=2"]
    proc, address = spawn_service("rollout", overrides, root / "ready.json")
    try:
        yield Rollout(address, checkpoint, proc)
    finally:
        stop_service(proc)


@pytest.fixture(scope="module")
def prompts() -> Iterator[tuple[BusServer, dict[str, TensorRef]]]:
    with serve_store() as server:
        refs = {
            uid: put_tensor(server.store, f"data/{uid}", "prompt_ids", torch.tensor(ids))
            for uid, ids in PROMPTS.items()
        }
        yield server, refs


def generate_request(
    refs: dict[str, TensorRef], step: int, tag: str, min_version: int = 0
) -> rollout_pb2.GenerateRequest:
    groups = [
        rollout_pb2.PromptGroup(prompt_uid="p0", prompt_ids=refs["p0"].to_proto(), sample_indices=[0, 1]),
        rollout_pb2.PromptGroup(prompt_uid="p1", prompt_ids=refs["p1"].to_proto(), sample_indices=[3]),
        rollout_pb2.PromptGroup(prompt_uid="p2", prompt_ids=refs["p2"].to_proto(), sample_indices=[0, 2]),
    ]
    return rollout_pb2.GenerateRequest(step=step, seed=7, groups=groups, params=WIRE_PARAMS, release_tag=tag,
                                       min_policy_version=min_version)  # fmt: skip


def local_requests() -> list[SampleRequest]:
    pairs = [("p0", 0), ("p0", 1), ("p1", 3), ("p2", 0), ("p2", 2)]
    return [SampleRequest(uid, idx, torch.tensor(PROMPTS[uid])) for uid, idx in pairs]


async def call(address: str, method: str, request: object) -> object:
    async with open_channel(address) as channel:
        return await getattr(rollout_pb2_grpc.RolloutStub(channel), method)(request, timeout=120)


def fetch_outputs(response: rollout_pb2.GenerateResponse) -> dict[str, torch.Tensor]:
    columns = ["latents", "log_probs", "sigmas", "timesteps", "images"]
    with BusClient() as client:
        out = {}
        for column in columns:
            fetched = client.fetch([TensorRef.from_proto(s.outputs[column]) for s in response.samples])
            out[column] = torch.stack([to_torch(f) for f in fetched])
    return out


def lora_update(version: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(version)
    return {
        Q + ".lora_A.weight": torch.randn(4, 64, generator=g),
        Q + ".lora_B.weight": torch.randn(64, 4, generator=g),
    }


def test_generate_and_weights_match_the_engine_in_this_process(
    rollout: Rollout, prompts: tuple[BusServer, dict[str, TensorRef]]
) -> None:
    server, refs = prompts
    local = NativeBagelEngine.from_checkpoint(
        rollout.checkpoint, device="cpu", dtype=torch.float32, max_batch_samples=3
    )

    response = asyncio.run(call(rollout.address, "Generate", generate_request(refs, 4, "s4")))
    assert [(s.prompt_uid, s.sample_index, s.policy_version) for s in response.samples] == [
        ("p0", 0, 0), ("p0", 1, 0), ("p1", 3, 0), ("p2", 0, 0), ("p2", 2, 0)]  # fmt: skip
    assert response.metrics.values["rollout/samples"] == 5
    remote = fetch_outputs(response)
    expected = local.generate(local_requests(), PARAMS, seed=7, step=4)
    # bitwise: same engine, same shapes (deterministic mode), batches of 2 there and 3 here
    assert torch.equal(remote["latents"], expected.latents)
    assert torch.equal(remote["log_probs"], expected.log_probs)
    assert torch.equal(remote["sigmas"], expected.sigmas) and torch.equal(
        remote["timesteps"], expected.timesteps
    )
    assert expected.images is not None and torch.equal(remote["images"], expected.images)
    assert [s.window_begin for s in response.samples] == expected.window_begin.tolist()

    # sampling.branch on the wire: the service's batches of 2 split p2's group, the engine's batches
    # of 3 here do not; each batch computes the prefix of its part of a group: still bitwise
    request = generate_request(refs, 4, "s4branch")
    request.params.branch = True
    branched = fetch_outputs(asyncio.run(call(rollout.address, "Generate", request)))
    expected = local.generate(local_requests(), replace(PARAMS, branch=True), seed=7, step=4)
    assert torch.equal(branched["latents"], expected.latents)
    assert torch.equal(branched["log_probs"], expected.log_probs)
    assert torch.equal(branched["latents"][3, 0], branched["latents"][4, 0])  # p2 shares x[begin]
    assert not torch.equal(branched["latents"][:, 0], remote["latents"][:, 0])  # the group's noise

    # a LoRA update published on the bus changes the remote samples exactly as in-process
    tensors = lora_update(1)
    update = common_pb2.WeightUpdate(
        policy_version=1, kind="lora", lora=common_pb2.LoraSpec(rank=4, alpha=8.0)
    )
    for name, tensor in tensors.items():
        ref = put_tensor(server.store, f"weights/v1/{name}", "weights", tensor, policy_version=1)
        update.tensors.append(common_pb2.NamedTensor(name=name, ref=ref.to_proto()))
    loaded = asyncio.run(call(rollout.address, "LoadWeights", rollout_pb2.LoadWeightsRequest(update=update)))
    assert loaded.policy_version == 1
    local.apply_update(PolicyUpdate(1, "lora", tensors, lora_rank=4, lora_alpha=8.0))
    response = asyncio.run(call(rollout.address, "Generate", generate_request(refs, 4, "s4b", min_version=1)))
    assert {s.policy_version for s in response.samples} == {1}
    after = fetch_outputs(response)
    assert torch.equal(after["latents"], local.generate(local_requests(), PARAMS, seed=7, step=4).latents)
    assert not torch.equal(after["latents"], remote["latents"])


def test_release_frees_a_tag_and_later_fetches_say_released(
    rollout: Rollout, prompts: tuple[BusServer, dict[str, TensorRef]]
) -> None:
    _, refs = prompts
    response = asyncio.run(call(rollout.address, "Generate", generate_request(refs, 9, "s9")))
    released = asyncio.run(call(rollout.address, "Release", rollout_pb2.ReleaseRequest(tags=["s9"])))
    # the tag held exactly the outputs of that response
    assert released.released_bytes == sum(ref.nbytes for s in response.samples for ref in s.outputs.values())
    with BusClient() as client, pytest.raises(Released):
        client.fetch([TensorRef.from_proto(response.samples[0].outputs["latents"])])


@pytest.mark.parametrize(
    ("mutate", "code", "fragment"),
    [
        (lambda r: r.params.__setattr__("height", 40), INVALID, "multiple of 16"),
        (lambda r: r.params.__setattr__("sde_type", "ode"), INVALID, "sde_type='ode'"),
        (lambda r: r.__setattr__("min_policy_version", 99), INVALID, "send LoadWeights first"),
        (lambda r: r.groups[0].prompt_ids.__setattr__("key", "data/nope"), PRECONDITION,
         "prompt ids not available on the bus"),
    ],
)  # fmt: skip
def test_bad_requests_fail_typed_and_the_service_keeps_serving(
    rollout: Rollout, prompts: tuple[BusServer, dict[str, TensorRef]], mutate: object, code: grpc.StatusCode,
    fragment: str,
) -> None:  # fmt: skip
    _, refs = prompts
    request = generate_request(refs, 5, "bad")
    mutate(request)  # type: ignore[operator]
    with pytest.raises(grpc.aio.AioRpcError) as error:
        asyncio.run(call(rollout.address, "Generate", request))
    assert error.value.code() == code and fragment in (error.value.details() or ""), error.value.details()
    ok = asyncio.run(call(rollout.address, "Generate", generate_request(refs, 5, "good", min_version=0)))
    assert len(ok.samples) == 5
