"""The trainer service as a real process: trajectories in from a bus store, a FlowGRPO step,
weights published on the bus, checkpoints and resume. Compared bitwise with the same step run
in this process (deterministic shapes, CPU fp32)."""

from __future__ import annotations

import asyncio
import subprocess
import sys
from collections.abc import Iterator, Sequence
from pathlib import Path

import grpc
import grpc.aio
import pytest
import torch

from flowgrpo.bus import BusClient, BusServer, TensorRef, serve_store
from flowgrpo.bus.torch_tensors import put_tensor, to_torch
from flowgrpo.configs.trainer import LossConfig, OptimConfig, PolicyConfig, TrainerConfig
from flowgrpo.models.bagel.checkpoint import load_bagel_model, load_special_tokens, make_tiny_bagel
from flowgrpo.models.bagel.sampling import BagelSampler, SampleRequest
from flowgrpo.runtime import open_channel
from flowgrpo.sampler_params import SamplerParams
from flowgrpo.services.trainer.policy import TrainablePolicy
from flowgrpo.services.trainer.step import TrainStep, Trajectory
from flowgrpo.v1 import common_pb2, common_pb2_grpc, trainer_pb2, trainer_pb2_grpc

from .launch import PYTHON_M, kill_service, spawn_service, stop_service

PARAMS = SamplerParams(num_points=6, height=32, width=32, window_size=2, window_range=(0, 4),
                       deterministic=True, decode_images=False, cfg_text_scale=2.0)  # fmt: skip
PROMPTS = {"p0": [384, 5, 6, 7, 385], "p1": [384, 9, 10, 385]}
ADVANTAGES = [1.0, -1.0, 0.5, -0.5]
OVERRIDES = ["trainer.policy.lora_rank=4", "trainer.policy.lora_alpha=8", "trainer.loss.mini_batches=1",
             "trainer.loss.micro_batch_size=1", "trainer.optim.lr=1e-3"]  # fmt: skip


TORCHRUN = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2", "--rdzv-backend", "c10d",
            "--rdzv-endpoint", "localhost:0", "-m"]  # fmt: skip


def start_trainer(
    checkpoint: Path, ckpt_dir: Path, ready: Path, launcher: Sequence[str] = PYTHON_M
) -> tuple[subprocess.Popen[str], str]:
    overrides = [f"trainer.checkpoint={checkpoint}", f"trainer.checkpoint_dir={ckpt_dir}", *OVERRIDES]
    return spawn_service("trainer", overrides, ready, launcher)


stop = stop_service


async def drain(address: str) -> None:
    """The way to stop a torchrun trainer cleanly (torchrun's agent itself exits 1 on SIGTERM)."""
    async with open_channel(address) as channel:
        await common_pb2_grpc.LifecycleStub(channel).Drain(common_pb2.DrainRequest(grace_s=30), timeout=30)


async def call(address: str, method: str, request: object) -> object:
    async with open_channel(address) as channel:
        return await getattr(trainer_pb2_grpc.TrainerStub(channel), method)(request, timeout=120)


@pytest.fixture(scope="module")
def tiny(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_tiny_bagel(tmp_path_factory.mktemp("tiny"), seed=0)


@pytest.fixture(scope="module")
def trajectories(tiny: Path) -> Iterator[tuple[BusServer, list[Trajectory], trainer_pb2.TrainStepRequest]]:
    sampler = BagelSampler(load_bagel_model(tiny, dtype=torch.float32), None, load_special_tokens(tiny))
    requests = [SampleRequest(uid, i, torch.tensor(ids)) for uid, ids in PROMPTS.items() for i in range(2)]
    out = sampler.generate(requests, PARAMS, seed=3, step=0)
    batch = [
        Trajectory(
            r.prompt_uid, r.sample_index, 0, a, r.prompt_ids, out.latents[i], out.log_probs[i], out.sigmas[i]
        )
        for i, (r, a) in enumerate(zip(requests, ADVANTAGES, strict=True))
    ]
    with serve_store() as server:
        samples = []
        for t in batch:
            key = f"s0/{t.prompt_uid}/{t.sample_index}"
            columns = {
                "prompt_ids": t.prompt_ids,
                "latents": t.latents,
                "log_probs": t.log_probs,
                "sigmas": t.sigmas,
            }
            inputs = {c: put_tensor(server.store, f"{key}/{c}", c, v).to_proto() for c, v in columns.items()}
            samples.append(
                trainer_pb2.TrainSample(
                    prompt_uid=t.prompt_uid, sample_index=t.sample_index, advantage=t.advantage, inputs=inputs
                )
            )
        request = trainer_pb2.TrainStepRequest(step=1, samples=samples, params=PARAMS.to_proto())
        yield server, batch, request


def fetch_update(update: object) -> dict[str, torch.Tensor]:
    with BusClient() as client:
        refs = [TensorRef.from_proto(t.ref) for t in update.tensors]  # type: ignore[attr-defined]
        return {t.name: to_torch(f).clone() for t, f in zip(update.tensors, client.fetch(refs), strict=True)}  # type: ignore[attr-defined]


def test_train_step_publish_checkpoint_and_resume(
    tiny: Path, tmp_path: Path, trajectories: tuple[BusServer, list[Trajectory], trainer_pb2.TrainStepRequest]
) -> None:
    _, batch, request = trajectories
    broken = trainer_pb2.TrainStepRequest()
    broken.CopyFrom(request)
    del broken.samples[0].inputs["log_probs"]
    proc, address = start_trainer(tiny, tmp_path / "ckpt", tmp_path / "ready.json")
    try:
        with pytest.raises(grpc.aio.AioRpcError) as error:  # a missing column is named, nothing trains
            asyncio.run(call(address, "TrainStep", broken))
        assert error.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert "lacks input columns ['log_probs']" in (error.value.details() or "")

        response = asyncio.run(call(address, "TrainStep", request))
        metrics = response.metrics.values
        assert metrics["actor/rollout_logp_gap/max"] == 0.0 and metrics["actor/ratio_mean"] == 1.0
        assert response.update.policy_version == 1 and response.update.kind == "lora"
        assert (response.update.lora.rank, response.update.lora.alpha) == (4, 8.0)
        published = fetch_update(response.update)

        policy = TrainablePolicy(
            load_bagel_model(tiny, dtype=torch.float32), PolicyConfig(lora_rank=4, lora_alpha=8.0)
        )
        loss = LossConfig(mini_batches=1, micro_batch_size=1)
        local = TrainStep(
            policy, load_special_tokens(tiny), TrainerConfig(optim=OptimConfig(lr=1e-3), loss=loss)
        )
        local.run(batch, PARAMS)
        expected = local.policy.published()
        assert published.keys() == expected.keys()
        assert all(torch.equal(published[n], expected[n]) for n in expected), (
            "same update as in-process, bitwise"
        )

        saved = asyncio.run(call(address, "SaveCheckpoint", trainer_pb2.SaveCheckpointRequest(step=1)))
        assert Path(saved.path).name == "step_00000001"
    finally:
        stop(proc)

    proc, address = start_trainer(tiny, tmp_path / "ckpt", tmp_path / "ready.json")
    try:
        state = asyncio.run(call(address, "State", trainer_pb2.TrainerStateRequest()))
        assert (state.step, state.policy_version) == (1, 1)
        again = fetch_update(state.current)
        assert all(torch.equal(again[n], published[n]) for n in published), "resumed weights are re-published"
    finally:
        stop(proc)


def test_torchrun_rank0_serves_and_rank1_follows(
    tiny: Path, tmp_path: Path, trajectories: tuple[BusServer, list[Trajectory], trainer_pb2.TrainStepRequest]
) -> None:
    """FSDP2 over 2 gloo processes behind one gRPC server: the update of one process."""
    _, batch, request = trajectories
    proc, address = start_trainer(tiny, tmp_path / "ckpt", tmp_path / "ready.json", TORCHRUN)
    try:
        response = asyncio.run(call(address, "TrainStep", request))
        published = fetch_update(response.update)
        saved = asyncio.run(call(address, "SaveCheckpoint", trainer_pb2.SaveCheckpointRequest(step=1)))
        assert (Path(saved.path) / "manifest.json").is_file()
        asyncio.run(drain(address))  # rank 0 drains, then tells rank 1 to stop: torchrun exits 0
        _, stderr = proc.communicate(timeout=60)
        assert proc.returncode == 0, stderr[-4000:]
    finally:
        kill_service(proc)
    policy = TrainablePolicy(
        load_bagel_model(tiny, dtype=torch.float32), PolicyConfig(lora_rank=4, lora_alpha=8.0)
    )
    local = TrainStep(
        policy,
        load_special_tokens(tiny),
        TrainerConfig(optim=OptimConfig(lr=1e-3), loss=LossConfig(mini_batches=1, micro_batch_size=1)),
    )
    local.run(batch, PARAMS)
    expected = local.policy.published()
    assert published.keys() == expected.keys()
    for name, tensor in expected.items():  # tolerance: gradients reduced across ranks in another order
        torch.testing.assert_close(published[name], tensor, rtol=1e-5, atol=1e-6, msg=name)
