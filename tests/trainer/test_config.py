"""The trainer's config refuses settings that cannot work, naming the key and the fix."""

from __future__ import annotations

import pytest

from flowgrpo.config import ConfigError, apply_overrides
from flowgrpo.configs.trainer import TrainerServiceConfig


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        (["trainer.publish_cuda_ipc=true"], r"publish_cuda_ipc needs a GPU trainer \(trainer.device='cpu'\)"),
        (["trainer.publish_bus=false"], "nothing publishes"),
        (["trainer.policy.lora_targets=[self_attn.q_proj]"], "outside the gen path"),
        (
            ["trainer.activation_checkpointing_every=2"],
            "no effect with trainer.activation_checkpointing=false",
        ),
        (
            ["trainer.activation_checkpointing=true", "trainer.activation_checkpointing_every=0"],
            "out of range: need 1 <=",
        ),
    ],
)
def test_impossible_publication_and_targets_are_refused(overrides: list[str], message: str) -> None:
    with pytest.raises(ConfigError, match=message):
        apply_overrides(TrainerServiceConfig(), ["trainer.checkpoint=/some/folder", *overrides])


def test_a_gpu_trainer_may_publish_over_cuda_ipc_only() -> None:
    config = apply_overrides(
        TrainerServiceConfig(),
        [
            "trainer.checkpoint=/x",
            "trainer.device=cuda",
            "trainer.publish_cuda_ipc=true",
            "trainer.publish_bus=false",
        ],
    )
    assert config.trainer.publish_cuda_ipc and not config.trainer.publish_bus
