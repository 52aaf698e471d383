"""Background checkpoints (``trainer.async_save``) of a trainer on a GPU (GPU only).

The staging there is the GPU's own: DCP's stager copying CUDA tensors into pinned host memory,
once per save and, for the full gen path, twice within one save (the weights, then AdamW's
moments). On torch 2.11 (the H200's) a stager reused that way failed at its second stage
(``KeyError: <class 'type'>``) while every CPU test passed; here three steps in a row are each
saved in the background through one HostStager, and each save holds what a synchronous save of
the same step holds."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest
import torch

from flowgrpo.configs.trainer import LossConfig, OptimConfig, PolicyConfig, TrainerConfig
from flowgrpo.models.bagel.checkpoint import load_bagel_model, load_special_tokens
from flowgrpo.services.trainer.checkpoint import HostStager, save_checkpoint, start_checkpoint
from flowgrpo.services.trainer.policy import TrainablePolicy
from flowgrpo.services.trainer.step import TrainStep

from .test_checkpoint import assert_same_contents, contents_of
from .test_step import LORA, PARAMS, rollout, sampler_for, tiny

__all__ = ["tiny"]  # the module-scoped checkpoint fixture

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU"),
]

GPU_PARAMS = dataclasses.replace(PARAMS, deterministic=False)  # CPU-only bitwise kernels


@pytest.mark.parametrize("policy", [LORA, PolicyConfig(kind="full")], ids=["lora", "full"])
def test_a_background_save_every_step_on_a_gpu_holds_what_a_synchronous_one_does(
    tiny: Path, tmp_path: Path, policy: PolicyConfig
) -> None:
    sampler = sampler_for(tiny)
    model = load_bagel_model(tiny, dtype=torch.float32, device="cuda:0")
    step = TrainStep(
        TrainablePolicy(model, policy),
        load_special_tokens(tiny),
        TrainerConfig(optim=OptimConfig(lr=1e-3), loss=LossConfig(mini_batches=1, micro_batch_size=2)),
    )
    stager = HostStager(pinned=True)
    try:
        for number in range(1, 4):
            batch = rollout(sampler, [1.0, -1.0, 0.5 * number, -0.5], step=number)
            for t in batch:
                t.policy_version = step.version
            step.run(batch, GPU_PARAMS)
            pending = start_checkpoint(tmp_path / "async", step, number, stager)
            synced = save_checkpoint(tmp_path / "sync", step, step=number)
            path = pending.wait()
            assert path == tmp_path / "async" / f"step_{number:08d}" and synced is not None
            assert_same_contents(contents_of(path), contents_of(synced))
    finally:
        stager.close()
