"""Trainer checkpoints: resume reproduces the next step bitwise; damage is refused whole."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest
import torch

from flowgrpo.services.trainer.checkpoint import (
    CheckpointError,
    latest_checkpoint,
    load_checkpoint,
    save_checkpoint,
)
from flowgrpo.services.trainer.config import PolicyConfig

from .test_step import LORA, PARAMS, rollout, sampler_for, tiny, trainer

__all__ = ["tiny"]  # the module-scoped checkpoint fixture


def state(step: object) -> dict[str, torch.Tensor]:
    return {n: p.detach().clone() for n, p in step.policy.trainable().items()}  # type: ignore[attr-defined]


@pytest.mark.parametrize("policy", [LORA, PolicyConfig(kind="full")], ids=["lora", "full"])
def test_resume_reproduces_the_next_step_bitwise(tiny: Path, tmp_path: Path, policy: PolicyConfig) -> None:
    sampler = sampler_for(tiny)
    first, second = rollout(sampler, [1.0, -1.0, 0.5, -0.5]), rollout(sampler, [0.3, -0.2, 1.0, -1.1], step=1)
    for t in second:
        t.policy_version = 1
    straight = trainer(tiny, policy)
    straight.run(first, PARAMS)
    path = save_checkpoint(tmp_path / "ckpt", straight, step=1)
    expected = straight.run(second, PARAMS)

    resumed = trainer(tiny, policy)
    assert load_checkpoint(path, resumed) == 1 and resumed.version == 1
    metrics = resumed.run(second, PARAMS)
    after, reference = state(resumed), state(straight)
    assert all(torch.equal(after[n], reference[n]) for n in reference), "weights after the resumed step"

    def numbers(m: dict[str, float]) -> dict[str, float]:
        return {k: v for k, v in m.items() if not k.startswith("timing_s/")}

    assert numbers(metrics) == numbers(expected), "every metric of the resumed step, bitwise"


def test_damaged_checkpoints_are_refused_and_nothing_is_loaded(tiny: Path, tmp_path: Path) -> None:
    step = trainer(tiny)
    step.run(rollout(sampler_for(tiny), [1.0, -1.0, 0.5, -0.5]), PARAMS)
    path = save_checkpoint(tmp_path, step, step=1)
    fresh = trainer(tiny)
    before = state(fresh)

    stray = path / "optimizer" / "shard-00009-model-00001-of-00001.safetensors"
    shutil.copy(next((path / "optimizer").iterdir()), stray)  # DCP would read it: refused
    with pytest.raises(CheckpointError, match=r"shard-00009-model-00001-of-00001.safetensors is not in"):
        load_checkpoint(path, fresh)
    stray.unlink()
    weights = path / "adapter" / "adapter_model.safetensors"
    weights.write_bytes(weights.read_bytes()[:-100])  # truncated
    with pytest.raises(CheckpointError, match=r"adapter_model.safetensors is corrupt or truncated"):
        load_checkpoint(path, fresh)
    (path / "manifest.json").unlink()
    with pytest.raises(CheckpointError, match=r"manifest\.json is missing"):
        load_checkpoint(path, fresh)
    assert all(torch.equal(p, before[n]) for n, p in state(fresh).items()) and fresh.version == 0


def test_keeps_the_last_n_and_finds_the_latest(tiny: Path, tmp_path: Path) -> None:
    step = trainer(tiny)
    for s in range(1, 5):
        save_checkpoint(tmp_path, step, step=s, keep_last=2)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["step_00000003", "step_00000004"]
    assert latest_checkpoint(tmp_path) == tmp_path / "step_00000004"
    assert latest_checkpoint(tmp_path / "none") is None
