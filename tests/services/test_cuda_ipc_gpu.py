"""CUDA IPC weight publication through the real rollout service's LoadWeights (GPU only).

This process plays the trainer: its policy (tiny BAGEL on cuda:0, the frozen base in one shared
allocation as ``trainer.share_base`` makes it) publishes version 1 through the trainer's own
``Publisher``, over the bus and over CUDA IPC at once. Three rollout services, each its own
process on the same GPU, load it three ways:

- ``bus``: the tensors fetched over the bus (the reference);
- ``ipc``: the LoRA bucket opened by CUDA IPC (the bus tensors removed, so nothing else can serve);
- ``shared``: ``rollout.base_weights=trainer``: the base mapped from the trainer's allocation,
  the LoRA bucket by CUDA IPC.

The three sample bitwise alike, and not like version 0: every publication path placed the same
weights. A handle the rollout's checks refused (torch's layout changed, say) fails here with
the field named, not as a silent fallback to the bus."""

from __future__ import annotations

import asyncio
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch

from flowgrpo.bus import BusServer, TensorRef, serve_store
from flowgrpo.bus.torch_tensors import put_tensor
from flowgrpo.models.bagel.checkpoint import make_tiny_bagel
from flowgrpo.services.trainer.distributed import Dist
from flowgrpo.services.trainer.load import load_policy
from flowgrpo.services.trainer.publish import Publisher
from flowgrpo.v1 import common_pb2, rollout_pb2
from tests.trainer.test_step import LORA

from .launch import kill_service, spawn_service, stop_service
from .test_rollout_service import PROMPTS, call, fetch_outputs, generate_request

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU"),
]

ROLLOUT = ["rollout.device=cuda:0", "rollout.dtype=float32", "rollout.compile=false",
           "rollout.max_batch_samples=8", "rollout.lora_mode=merge"]  # fmt: skip


@dataclass
class Published:
    store: BusServer
    prompts: dict[str, TensorRef]
    update: common_pb2.WeightUpdate  # version 1: bus tensors, one CUDA IPC bucket, the shared base
    publisher: Publisher  # keeps the buckets alive while rollouts map them


@pytest.fixture(scope="module")
def tiny(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_tiny_bagel(tmp_path_factory.mktemp("tiny"), seed=0)


@pytest.fixture(scope="module")
def published(tiny: Path) -> Iterator[Published]:
    policy = load_policy(tiny, LORA, Dist(), dtype=torch.float32, device="cuda:0", share_base=True)
    assert policy.base_bucket is not None
    base = policy.base_bucket.finish()
    g = torch.Generator(device="cuda:0").manual_seed(1)
    with torch.no_grad():  # a LoRA that moves the samples (B starts at zero)
        for param in policy.trainable().values():
            param.copy_(torch.randn(param.shape, generator=g, device="cuda:0") * 0.2)
    with serve_store() as server:
        prompts = {
            uid: put_tensor(server.store, f"data/{uid}", "prompt_ids", torch.tensor(ids))
            for uid, ids in PROMPTS.items()
        }
        publisher = Publisher(policy, server.store, bus=True, cuda_ipc=True, base=base)
        update = publisher.publish(1)
        assert len(update.cuda_ipc) == 1 and update.HasField("base") and update.tensors
        yield Published(server, prompts, update, publisher)
        publisher.close()


def variant(update: common_pb2.WeightUpdate, *, bus: bool, ipc: bool, base: bool) -> common_pb2.WeightUpdate:
    out = common_pb2.WeightUpdate()
    out.CopyFrom(update)
    if not bus:
        out.ClearField("tensors")
    if not ipc:
        out.ClearField("cuda_ipc")
    if not base:
        out.ClearField("base")
    return out


def load_and_sample(
    address: str, update: common_pb2.WeightUpdate, refs: dict[str, TensorRef]
) -> torch.Tensor:
    loaded = asyncio.run(call(address, "LoadWeights", rollout_pb2.LoadWeightsRequest(update=update)))
    assert loaded.policy_version == 1  # type: ignore[attr-defined]
    response = asyncio.run(call(address, "Generate", generate_request(refs, 2, "v1", min_version=1)))
    return fetch_outputs(response)["latents"]  # type: ignore[arg-type]


def test_lora_and_shared_base_published_by_cuda_ipc_sample_like_the_bus(
    tiny: Path, published: Published, tmp_path: Path
) -> None:
    cases = {
        "bus": ([], dict(bus=True, ipc=False, base=False)),
        "ipc": ([], dict(bus=False, ipc=True, base=False)),
        "shared": (["rollout.base_weights=trainer"], dict(bus=False, ipc=True, base=True)),
    }
    latents, before = {}, None
    for name, (extra, paths) in cases.items():
        overrides = [f"rollout.checkpoint={tiny}", *ROLLOUT, *extra]
        proc, address = spawn_service("rollout", overrides, tmp_path / f"{name}.json")
        try:
            if name == "bus":  # version 0, for the 'the update moved the samples' check
                response = asyncio.run(
                    call(address, "Generate", generate_request(published.prompts, 2, "v0"))
                )
                before = fetch_outputs(response)["latents"]  # type: ignore[arg-type]
            latents[name] = load_and_sample(address, variant(published.update, **paths), published.prompts)
            stop_service(proc)
        finally:
            kill_service(proc)
    assert before is not None and not torch.equal(latents["bus"], before), "the update moved the samples"
    assert torch.equal(latents["ipc"], latents["bus"]), "LoRA by CUDA IPC vs the bus"
    assert torch.equal(latents["shared"], latents["bus"]), "shared base + LoRA by CUDA IPC vs the bus"
