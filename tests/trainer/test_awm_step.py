"""One Advantage Weighted Matching step on a tiny BAGEL (CPU, fp32, deterministic shapes): the
advantage's sign sets what the model learns, the average of past policies moves as the schedule
says and is not what is published, the draws are a function of coordinates, and a checkpoint
carries the average."""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

import pytest
import torch

from flowgrpo.algorithms.awm.objective import AWMObjective
from flowgrpo.configs.trainer import AwmConfig, LossConfig, OptimConfig, PolicyConfig, TrainerConfig
from flowgrpo.models.bagel.checkpoint import load_bagel_model, load_special_tokens, make_tiny_bagel
from flowgrpo.sampler_math import shifted_schedule
from flowgrpo.services.trainer.checkpoint import CheckpointError, load_checkpoint, save_checkpoint
from flowgrpo.services.trainer.policy import TrainablePolicy
from flowgrpo.services.trainer.step import TrainStep

from .test_nft_step import LORA, PARAMS, clean_samples, denoising_error


@pytest.fixture(scope="module")
def tiny(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_tiny_bagel(tmp_path_factory.mktemp("tiny"), seed=0)


def awm_trainer(
    tiny: Path, policy: PolicyConfig = LORA, mini_batches: int = 1, kl_beta: float = 0.0, **awm: float
) -> TrainStep:
    """3 times a sample: on PARAMS' 5-step schedule, the points 1, 2 and 3 (one per stratum)."""
    model = load_bagel_model(tiny, dtype=torch.float32)
    loss = LossConfig(mini_batches=mini_batches, micro_batch_size=1, kl_beta=kl_beta)
    config = AwmConfig(**{"train_times": 3, **awm})  # type: ignore[arg-type]
    return TrainStep(
        TrainablePolicy(model, policy, keep_reference=kl_beta > 0),
        load_special_tokens(tiny),
        TrainerConfig(algorithm=config, optim=OptimConfig(lr=1e-2), loss=loss),
    )


@pytest.mark.parametrize("policy", [LORA, PolicyConfig(kind="full")], ids=["lora", "full"])
def test_the_advantage_decides_which_images_the_model_learns_to_make(
    tiny: Path, policy: PolicyConfig
) -> None:
    """A = +1: the step makes the model predict that clean latent better; A = -1: worse (the other
    samples at A = 0 contribute nothing)."""
    for a in (1.0, -1.0):
        batch = clean_samples(tiny, [a, 0.0, 0.0, 0.0])
        step = awm_trainer(tiny, policy)
        before = denoising_error(step, batch[0])
        metrics = step.run(batch, PARAMS, seed=1, step=1)
        after = denoising_error(step, batch[0])
        assert (after < before) if a > 0 else (after > before), (a, before, after)
        assert metrics["actor/grad_norm"] > 0 and metrics["actor/skipped_steps"] == 0
        assert metrics["actor/awm/matching_loss"] > 0 and metrics["actor/awm/ema_kl"] == 0.0  # ema = start
        assert step.version == 1 and metrics["trainer/lag/max"] == 0.0


def test_the_average_follows_its_schedule_and_rollouts_get_the_trained_policy(tiny: Path) -> None:
    """After k optimizer steps in all, ema <- d ema + (1 - d) current with d = min(rate k, max), as
    the reference counts its global steps (2 mini-batches: 2 a step); the published policy is the
    trained one, not the average."""
    step = awm_trainer(tiny, mini_batches=2, ema_decay_rate=0.1, ema_decay_max=0.3)
    initial = {n: p.detach().clone() for n, p in step.policy.trainable().items()}
    batch = clean_samples(tiny, [1.0, -1.0, 0.5, -0.5])
    metrics = step.run(batch, PARAMS, seed=1, step=1)
    assert metrics["actor/awm/ema_decay"] == pytest.approx(0.2) and step.optimizer_steps == 2
    assert metrics["actor/awm/ema_kl"] > 0  # the second mini-batch is pulled toward the step's start
    current = {n: p.detach().clone() for n, p in step.policy.trainable().items()}
    for name, ema in step.policy.old_state().items():
        torch.testing.assert_close(ema, 0.2 * initial[name] + 0.8 * current[name], rtol=0, atol=1e-7)
    with step.sampling_policy():
        published = step.policy.published()
    assert all(torch.equal(published[step.policy.published_name(n)], p) for n, p in current.items())
    assert step.run(batch, PARAMS, seed=1, step=2)["actor/awm/ema_decay"] == 0.3  # min(0.4, 0.3)


def test_without_its_pull_no_average_is_kept(tiny: Path) -> None:
    step = awm_trainer(tiny, ema_kl_beta=0.0)
    metrics = step.run(clean_samples(tiny, [1.0, -1.0, 0.5, -0.5]), PARAMS, seed=1, step=1)
    assert (
        not step.keeps_old_policy
        and "actor/awm/ema_kl" not in metrics
        and "actor/awm/ema_decay" not in metrics
    )
    with pytest.raises(RuntimeError, match="keeps no old policy"):
        step.policy.old_state()


def test_the_reference_pull_is_measured_when_on(tiny: Path) -> None:
    """LoRA's reference is the model with its adapters off: equal to the policy before any update
    (B = 0), apart after one, so the second step's KL is positive."""
    step = awm_trainer(tiny, kl_beta=3e-3)
    batch = clean_samples(tiny, [1.0, -1.0, 0.5, -0.5])
    assert step.run(batch, PARAMS, seed=1, step=1)["actor/kl_loss"] == 0.0
    assert step.run(batch, PARAMS, seed=1, step=2)["actor/kl_loss"] > 0


def test_a_weight_outside_minus_1_1_trains_as_its_clamp(tiny: Path) -> None:
    """The reference clips A to [-1, 1] (after its scale); a target beyond it (the wire allows
    |A| <= 1e6) trains exactly as the clamped one."""
    wide, clamped = awm_trainer(tiny), awm_trainer(tiny)
    wide.run(clean_samples(tiny, [3.0, -2.0, 0.5, 0.0]), PARAMS, seed=1, step=1)
    clamped.run(clean_samples(tiny, [1.0, -1.0, 0.5, 0.0]), PARAMS, seed=1, step=1)
    for name, value in wide.policy.trainable().items():
        assert torch.equal(value, clamped.policy.trainable()[name]), name


def awm_objective(step: TrainStep) -> AWMObjective:
    assert isinstance(step.objective, AWMObjective)
    return step.objective


def test_draws_depend_on_coordinates_not_on_the_batch(tiny: Path) -> None:
    """A sample's times (one per stratum of the schedule's points) and noises are a function of
    (seed, step, prompt, sample): the same in another batch position or with another target,
    others at another step."""
    objective = awm_objective(awm_trainer(tiny))
    batch = clean_samples(tiny, [1.0, -1.0, 0.5, 0.0])
    times, noises = objective.draw(batch[2], PARAMS, 1, 1)
    again = objective.draw(replace(batch[2], advantage=0.0), PARAMS, 1, 1)
    other_step = objective.draw(batch[2], PARAMS, 1, 2)
    assert torch.equal(times, again[0]) and torch.equal(noises, again[1])
    assert not torch.equal(noises, other_step[1])
    schedule = shifted_schedule(PARAMS.num_points, PARAMS.timestep_shift)
    assert torch.equal(times, schedule[[1, 2, 3]])  # strata [1, 2), [2, 3), [3, 4) of int(5 x 0.9) = 4
    assert noises.shape == (3, *batch[2].final_latents.shape)  # type: ignore[union-attr]
    # from the first point (PickScore's strata): [0, 1), [1, 2), [2, 4): the last anywhere in its stratum
    wide = awm_objective(awm_trainer(tiny, from_first_point=True))
    draws = [wide.draw(batch[2], PARAMS, 1, k)[0] for k in range(16)]
    assert all(torch.equal(d[:2], schedule[[0, 1]]) for d in draws)
    assert {float(d[2]) for d in draws} == {float(schedule[2]), float(schedule[3])}


def test_a_step_is_reproducible_and_independent_of_batch_order(tiny: Path) -> None:
    """Deterministic mode, micro-batch 1: the same step twice gives bitwise the same weights; in
    another batch order, the same weights within float summation order (AdamW's first step moves
    each weight by about lr whatever the gradient's size: 1e-5 is 1e-3 of the step)."""
    batch = clean_samples(tiny, [1.0, -1.0, 0.5, -0.25])
    weights = []
    for order in ([0, 1, 2, 3], [0, 1, 2, 3], [3, 1, 0, 2]):
        step = awm_trainer(tiny)
        step.run([batch[i] for i in order], PARAMS, seed=1, step=1)
        weights.append({n: p.detach().clone() for n, p in step.policy.trainable().items()})
    assert all(torch.equal(weights[0][n], weights[1][n]) for n in weights[0])
    for n in weights[0]:
        torch.testing.assert_close(weights[2][n], weights[0][n], rtol=0, atol=1e-5)


def test_a_checkpoint_carries_the_average(tiny: Path, tmp_path: Path) -> None:
    step = awm_trainer(tiny, mini_batches=2, ema_decay_rate=0.25)
    batch = clean_samples(tiny, [1.0, -1.0, 0.5, -0.5])
    step.run(batch, PARAMS, seed=1, step=1)
    path = save_checkpoint(tmp_path, step, step=1)
    assert path is not None
    resumed = awm_trainer(tiny, mini_batches=2, ema_decay_rate=0.25)
    assert load_checkpoint(path, resumed) == 1
    assert (resumed.version, resumed.steps_done, resumed.optimizer_steps) == (1, 1, 2)  # the decay's count
    for name, ema in step.policy.old_state().items():
        assert torch.equal(resumed.policy.old_state()[name], ema)
    with pytest.raises(CheckpointError, match="resume with the algorithm it was saved with"):
        load_checkpoint(path, awm_trainer(tiny, ema_kl_beta=0.0))
