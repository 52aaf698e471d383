"""The algorithms' torch-free specs: what the coordinator computes and checks through them."""

from __future__ import annotations

import subprocess
import sys

import pytest

from flowgrpo.algorithms import ALGORITHMS, algorithm_of
from flowgrpo.sampler_params import SamplerSettings
from flowgrpo.services.trainer.config import DgpoConfig, LossConfig, NftConfig, TrainerConfig

ADVANTAGES = {"p0": [2.5, -7.0, 0.0, 1.0], "p1": [-0.5, 6.0]}


def test_the_specs_and_the_coordinator_import_no_torch() -> None:
    """The coordinator computes targets through the specs: they must not pull torch in."""
    code = (
        "import sys; import flowgrpo.algorithms, flowgrpo.services.coordinator.config, "
        "flowgrpo.services.coordinator.advantages; print('torch' in sys.modules)"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "False"


def test_flow_grpo_trains_on_the_advantages_as_they_are() -> None:
    for name in ("flow_grpo", "grpo_guard"):
        assert ALGORITHMS[name].targets(ADVANTAGES, TrainerConfig()) == ADVANTAGES


def test_diffusion_nft_targets_are_the_clipped_advantages_mapped_onto_0_1() -> None:
    """r = clip(A, -c, c) / (2 c) + 1/2, written out for c = 5: A = 2.5 -> 0.75, -7 -> 0 (clipped),
    0 -> 0.5, 1 -> 0.6, -0.5 -> 0.45, 6 -> 1 (clipped)."""
    trainer = TrainerConfig(algorithm="diffusion_nft", nft=NftConfig(adv_clip=5.0))
    targets = ALGORITHMS["diffusion_nft"].targets(ADVANTAGES, trainer)
    assert targets == {"p0": [0.75, 0.0, 0.5, 0.6], "p1": [0.45, 1.0]}


def test_dgpo_targets_are_the_advantages_clipped_as_they_weigh_a_group() -> None:
    """A clipped to [-c, c] (c = 5 here, 2 below), nothing else: the signs and sizes weigh the
    group's samples in its log-sigmoid."""
    trainer = TrainerConfig(algorithm="dgpo")
    assert ALGORITHMS["dgpo"].targets(ADVANTAGES, trainer) == {"p0": [2.5, -5.0, 0.0, 1.0], "p1": [-0.5, 5.0]}
    narrow = TrainerConfig(algorithm="dgpo", dgpo=DgpoConfig(adv_clip=2.0))
    assert ALGORITHMS["dgpo"].targets(ADVANTAGES, narrow) == {"p0": [2.0, -2.0, 0.0, 1.0], "p1": [-0.5, 2.0]}


def test_each_algorithm_names_the_columns_it_trains_on() -> None:
    assert ALGORITHMS["flow_grpo"].columns == ("prompt_ids", "latents", "log_probs", "sigmas")
    assert ALGORITHMS["grpo_guard"].columns == ALGORITHMS["flow_grpo"].columns
    assert ALGORITHMS["diffusion_nft"].columns == ("prompt_ids", "final_latents")
    assert ALGORITHMS["dgpo"].columns == ("prompt_ids", "final_latents")


def test_the_trainer_config_names_its_algorithm() -> None:
    assert algorithm_of(TrainerConfig()).name == "flow_grpo"
    assert algorithm_of(TrainerConfig(loss=LossConfig(mode="grpo_guard"))).name == "grpo_guard"
    assert algorithm_of(TrainerConfig(algorithm="diffusion_nft")).name == "diffusion_nft"
    assert algorithm_of(TrainerConfig(algorithm="dgpo")).name == "dgpo"


@pytest.mark.parametrize(
    ("trainer", "sampling", "message"),
    [
        (TrainerConfig(loss=LossConfig(mode="grpo_guard")), SamplerSettings(sde_type="cps"), "sde_type=sde"),
        (TrainerConfig(loss=LossConfig(mode="grpo_guard", logp_old="bypass")), None, "logp_old=recompute"),
        (TrainerConfig(algorithm="diffusion_nft", loss=LossConfig(max_logp_gap=1e-3)), None, "max_logp_gap"),
        (TrainerConfig(algorithm="diffusion_nft", loss=LossConfig(mode="grpo_guard")), None, "has its own"),
        (TrainerConfig(algorithm="dgpo", loss=LossConfig(max_logp_gap=1e-3)), None, "max_logp_gap"),
        (TrainerConfig(algorithm="dgpo", loss=LossConfig(mode="grpo_guard")), None, "dgpo has its own"),
        (
            TrainerConfig(algorithm="dgpo"),
            SamplerSettings(num_points=4, window_range=(0, 3)),
            "trainer.dgpo.time_points=5 exceeds the schedule's 3 steps",
        ),
    ],
)
def test_cross_section_checks_name_the_keys(
    trainer: TrainerConfig, sampling: SamplerSettings | None, message: str
) -> None:
    with pytest.raises(ValueError, match=message):
        algorithm_of(trainer).check(trainer, sampling)


def test_settings_that_fit_pass_every_check() -> None:
    for trainer in (TrainerConfig(), TrainerConfig(loss=LossConfig(mode="grpo_guard")),
                    TrainerConfig(algorithm="diffusion_nft"), TrainerConfig(algorithm="dgpo")):  # fmt: skip
        algorithm_of(trainer).check(trainer, SamplerSettings())
