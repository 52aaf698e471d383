"""The algorithms' torch-free specs: what the coordinator computes and checks through them."""

from __future__ import annotations

import subprocess
import sys

import pytest
import torch

from flowgrpo.algorithms import ALGORITHMS, algorithm_of
from flowgrpo.algorithms.awm import time_strata
from flowgrpo.config import ConfigError, validate
from flowgrpo.configs.trainer import AwmConfig, DgpoConfig, LossConfig, NftConfig, TrainerConfig
from flowgrpo.sampler_params import SamplerSettings

ADVANTAGES = {"p0": [2.5, -7.0, 0.0, 1.0], "p1": [-0.5, 6.0]}


def test_the_specs_and_the_coordinator_import_no_torch() -> None:
    """The coordinator computes targets through the specs: they must not pull torch in."""
    code = (
        "import sys; import flowgrpo.algorithms, flowgrpo.configs.run, "
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
    trainer = TrainerConfig(algorithm=NftConfig(adv_clip=5.0))
    targets = ALGORITHMS["diffusion_nft"].targets(ADVANTAGES, trainer)
    assert targets == {"p0": [0.75, 0.0, 0.5, 0.6], "p1": [0.45, 1.0]}


def test_awm_targets_are_the_clipped_advantages_divided_by_the_clip() -> None:
    """A / c after clipping to +-c, written out for c = 5: 2.5 -> 0.5, -7 -> -1 (clipped), 0 -> 0,
    1 -> 0.2, -0.5 -> -0.1, 6 -> 1 (clipped); c = 2: 1 -> 0.5, 2.5 -> 1."""
    targets = ALGORITHMS["awm"].targets(ADVANTAGES, TrainerConfig(algorithm=AwmConfig()))
    assert targets == {"p0": [0.5, -1.0, 0.0, 0.2], "p1": [-0.1, 1.0]}
    narrow = ALGORITHMS["awm"].targets(ADVANTAGES, TrainerConfig(algorithm=AwmConfig(adv_clip=2.0)))
    assert narrow == {"p0": [1.0, -1.0, 0.0, 0.5], "p1": [-0.25, 1.0]}


def reference_strata(num_steps: int, fraction: float, count: int, first: int) -> list[tuple[int, int]]:
    """The reference's strata ("discrete" from 0, "discrete_wo_init" from 1): float32 linspace
    boundaries between first and int(num_steps x fraction), each rounded down by ``.long()``."""
    bounds = torch.linspace(first, int(num_steps * fraction), steps=count + 1)
    return list(zip(bounds[:-1].long().tolist(), bounds[1:].long().tolist(), strict=True))


@pytest.mark.parametrize("first", [0, 1])
def test_awm_time_strata_are_the_references(first: int) -> None:
    """GenEval / OCR (from 1) and PickScore (from 0) on the reference's 14 steps, and every
    schedule of 2 to 40 steps with 1 to 8 times and fractions 0.5 to 1."""
    geneval = time_strata(14, AwmConfig(from_first_point=first == 0))
    assert geneval == [(first, 2), (2, 4), (4, 6), (6, 8), (8, 10), (10, 12)]
    for steps in range(2, 41):
        for count in range(1, 9):
            for fraction in (0.5, 0.6, 0.9, 0.99, 1.0):
                if int(steps * fraction) <= first:
                    continue
                config = AwmConfig(train_times=count, timestep_fraction=fraction, from_first_point=first == 0)
                assert time_strata(steps, config) == reference_strata(steps, fraction, count, first)


def test_awm_config_refuses_what_has_no_meaning() -> None:
    bad_fields = ({"ema_decay_max": 1.0}, {"loss_power": 0.0}, {"adv_clip": 0.0}, {"timestep_fraction": 0.0},
                  {"train_times": 0}, {"loss_power": 1.5})  # fmt: skip
    for fields in bad_fields:
        bad = AwmConfig(**fields)  # type: ignore[arg-type]
        with pytest.raises(ConfigError, match=r"trainer\.algorithm\."):
            validate(TrainerConfig(algorithm=bad), "trainer")


def test_dgpo_targets_are_the_advantages_clipped_as_they_weigh_a_group() -> None:
    """A clipped to [-c, c] (c = 5 here, 2 below), nothing else: the signs and sizes weigh the
    group's samples in its log-sigmoid."""
    trainer = TrainerConfig(algorithm=DgpoConfig())
    assert ALGORITHMS["dgpo"].targets(ADVANTAGES, trainer) == {"p0": [2.5, -5.0, 0.0, 1.0], "p1": [-0.5, 5.0]}
    narrow = TrainerConfig(algorithm=DgpoConfig(adv_clip=2.0))
    assert ALGORITHMS["dgpo"].targets(ADVANTAGES, narrow) == {"p0": [2.0, -2.0, 0.0, 1.0], "p1": [-0.5, 2.0]}


def test_each_algorithm_names_the_columns_it_trains_on() -> None:
    assert ALGORITHMS["flow_grpo"].columns == ("prompt_ids", "latents", "log_probs", "sigmas")
    assert ALGORITHMS["grpo_guard"].columns == ALGORITHMS["flow_grpo"].columns
    assert ALGORITHMS["diffusion_nft"].columns == ("prompt_ids", "final_latents")
    assert ALGORITHMS["awm"].columns == ("prompt_ids", "final_latents")
    assert ALGORITHMS["dgpo"].columns == ("prompt_ids", "final_latents")


def test_the_trainer_config_names_its_algorithm() -> None:
    assert algorithm_of(TrainerConfig()).name == "flow_grpo"
    assert algorithm_of(TrainerConfig(loss=LossConfig(mode="grpo_guard"))).name == "grpo_guard"
    assert algorithm_of(TrainerConfig(algorithm=NftConfig())).name == "diffusion_nft"
    assert algorithm_of(TrainerConfig(algorithm=AwmConfig())).name == "awm"
    assert algorithm_of(TrainerConfig(algorithm=DgpoConfig())).name == "dgpo"


@pytest.mark.parametrize(
    ("trainer", "sampling", "message"),
    [
        (TrainerConfig(loss=LossConfig(mode="grpo_guard")), SamplerSettings(sde_type="cps"), "sde_type=sde"),
        (TrainerConfig(loss=LossConfig(mode="grpo_guard", logp_old="bypass")), None, "logp_old=recompute"),
        (TrainerConfig(algorithm=NftConfig(), loss=LossConfig(max_logp_gap=1e-3)), None, "max_logp_gap"),
        (TrainerConfig(algorithm=NftConfig(), loss=LossConfig(mode="grpo_guard")), None, "has its own"),
        (TrainerConfig(algorithm=AwmConfig(), loss=LossConfig(max_logp_gap=1e-3)), None, "max_logp_gap"),
        (TrainerConfig(algorithm=AwmConfig(), loss=LossConfig(mode="grpo_guard")), None, "has its own"),
        # 1 step: int(1 x 0.9) = 0, no point after t = 1 to train
        (
            TrainerConfig(algorithm=AwmConfig()),
            SamplerSettings(num_points=2, window_size=1, window_range=(0, 1)),
            r"raise sampling\.num_points",
        ),
        (
            TrainerConfig(algorithm=AwmConfig(timestep_fraction=0.1)),
            SamplerSettings(),
            r"\[1, int\(14 x 0\.1\) = 1\)",
        ),
        (TrainerConfig(algorithm=DgpoConfig(), loss=LossConfig(max_logp_gap=1e-3)), None, "max_logp_gap"),
        (TrainerConfig(algorithm=DgpoConfig(), loss=LossConfig(mode="grpo_guard")), None, "dgpo has its own"),
        (
            TrainerConfig(algorithm=DgpoConfig()),
            SamplerSettings(num_points=4, window_range=(0, 3)),
            "trainer.algorithm.time_points=5 exceeds the schedule's 3 steps",
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
                    TrainerConfig(algorithm=NftConfig()), TrainerConfig(algorithm=AwmConfig()),
                    TrainerConfig(algorithm=AwmConfig(from_first_point=True,
                                                                 timestep_fraction=0.1)),
                    TrainerConfig(algorithm=DgpoConfig())):  # fmt: skip
        algorithm_of(trainer).check(trainer, SamplerSettings())
