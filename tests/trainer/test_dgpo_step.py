"""One DGPO training step on a tiny BAGEL (CPU, fp32): the advantage decides which images the model
learns to make, the gradient does not depend on how micro-batches cut the groups, the draws are
functions of coordinates, the old policy follows the reference's EMA and becomes what rollouts
sample with, and a checkpoint carries it."""

from __future__ import annotations

import math
from dataclasses import replace
from pathlib import Path

import pytest
import torch

from flowgrpo.configs.trainer import DgpoConfig, LossConfig, OptimConfig, PolicyConfig, TrainerConfig
from flowgrpo.models.bagel.checkpoint import load_bagel_model, load_special_tokens, make_tiny_bagel
from flowgrpo.sampler_math import shifted_schedule
from flowgrpo.services.trainer.checkpoint import load_checkpoint, save_checkpoint
from flowgrpo.services.trainer.policy import TrainablePolicy
from flowgrpo.services.trainer.step import TrainStep
from tests.trainer.test_nft_step import LORA, PARAMS, clean_samples, denoising_error

# the batch of clean_samples: groups p0 (rows 0, 1) and p1 (rows 2, 3)
ADVANTAGES = [1.0, -1.0, 0.5, -0.5]


@pytest.fixture(scope="module")
def tiny(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_tiny_bagel(tmp_path_factory.mktemp("tiny"), seed=0)


def dgpo_trainer(
    tiny: Path,
    policy: PolicyConfig = LORA,
    *,
    mini_batches: int = 1,
    micro_batch_size: int = 1,
    lr: float = 1e-2,
    kl_beta: float = 0.0,
    **dgpo: object,
) -> TrainStep:
    model = load_bagel_model(tiny, dtype=torch.float32)
    loss = LossConfig(mini_batches=mini_batches, micro_batch_size=micro_batch_size, kl_beta=kl_beta)
    config = DgpoConfig(**dgpo)  # type: ignore[arg-type]
    return TrainStep(
        TrainablePolicy(model, policy, keep_reference=True),
        load_special_tokens(tiny),
        TrainerConfig(algorithm=config, optim=OptimConfig(lr=lr), loss=loss),
    )


def trainable(step: TrainStep) -> dict[str, torch.Tensor]:
    return {n: p.detach().clone() for n, p in step.policy.trainable().items()}


@pytest.mark.parametrize("policy", [LORA, PolicyConfig(kind="full")], ids=["lora", "full"])
def test_the_advantage_decides_which_images_the_model_learns_to_make(
    tiny: Path, policy: PolicyConfig
) -> None:
    """A > 0: the step makes the model denoise that clean latent better; A < 0: worse (the other
    samples at A = 0 weigh nothing). At the first step the policy is the frozen base: every group
    weighs 1/2 and its loss is log 2."""
    for sign in (1.0, -1.0):
        batch = clean_samples(tiny, [sign, 0.0, 0.0, 0.0])
        step = dgpo_trainer(tiny, policy)
        before = denoising_error(step, batch[0])
        metrics = step.run(batch, PARAMS, seed=1, step=1)
        after = denoising_error(step, batch[0])
        assert (after < before) if sign > 0 else (after > before), (sign, before, after)
        assert metrics["actor/pg_loss"] == pytest.approx(math.log(2), abs=1e-12)
        assert metrics["actor/dgpo/weight"] == pytest.approx(0.5, abs=1e-12)
        assert metrics["actor/dgpo/error_gap"] == 0.0 and metrics["actor/pg_clipfrac"] == 0.0
        assert metrics["actor/grad_norm"] > 0 and metrics["actor/skipped_steps"] == 0


def test_a_group_s_positive_and_negative_move_apart(tiny: Path) -> None:
    """Both in one group, on the same noise (LoRA): the positive's error falls, the negative's rises."""
    batch = clean_samples(tiny, ADVANTAGES)
    step = dgpo_trainer(tiny)
    before = [denoising_error(step, batch[i]) for i in (0, 1)]
    step.run(batch, PARAMS, seed=1, step=1)
    after = [denoising_error(step, batch[i]) for i in (0, 1)]
    assert after[0] < before[0] and after[1] > before[1], (before, after)


def gradients(step: TrainStep) -> dict[str, torch.Tensor]:
    """The last mini-batch's gradient (the optimizer's step leaves it in place)."""
    return {n: p.grad.clone() for n, p in step.policy.trainable().items() if p.grad is not None}


def test_micro_batches_of_one_and_of_whole_groups_give_the_same_gradient_and_weights(tiny: Path) -> None:
    """Micro-batch 1 splits every group; 2 holds one group; 4 the batch: the pre-pass makes the
    gradient the unsplit one (to float summation order: 1e-5 of its largest entry), so the weights
    agree too (AdamW moves a weight by about lr = 1e-2 a step whatever the gradient's size, and its
    second step divides by the first's gradient: 1e-4 is 1e-2 of a step). The first step, at the
    base, weighs every group 1/2 whatever the split: the second is the one compared."""
    batch = clean_samples(tiny, ADVANTAGES)
    runs = []
    for size in (1, 2, 4):
        step = dgpo_trainer(tiny, micro_batch_size=4, clip_range=math.inf)
        step.run(batch, PARAMS, seed=1, step=1)  # away from the base (groups weigh != 1/2), alike
        step.forwards.micro_batch_size = size
        metrics = step.run(batch, PARAMS, seed=1, step=2)
        runs.append((gradients(step), trainable(step), metrics))
    (grads, weights, metrics), others = runs[0], runs[1:]
    assert metrics["actor/dgpo/weight"] != pytest.approx(0.5, abs=1e-6)
    for other_grads, other_weights, other_metrics in others:
        assert grads.keys() == other_grads.keys() and grads
        for n in grads:
            assert (other_grads[n] - grads[n]).abs().max() <= 1e-5 * grads[n].abs().max(), n
            torch.testing.assert_close(other_weights[n], weights[n], rtol=0, atol=1e-4)
        assert other_metrics["actor/pg_loss"] == pytest.approx(metrics["actor/pg_loss"], rel=1e-5)


def test_draws_depend_on_coordinates_not_on_the_batch(tiny: Path) -> None:
    """Times: distinct points among the schedule's first time_points, the same for the whole step;
    noise: one per (group, time), a function of (seed, step, prompt) only."""
    step = dgpo_trainer(tiny)
    objective = step.objective
    batch = clean_samples(tiny, ADVANTAGES)
    times = objective.draw_times(PARAMS, 1, 1)  # type: ignore[attr-defined]
    assert torch.equal(times, objective.draw_times(PARAMS, 1, 1))  # type: ignore[attr-defined]
    schedule = shifted_schedule(PARAMS.num_points, PARAMS.timestep_shift)[:5].tolist()
    assert times.numel() == 4 and len(set(times.tolist())) == 4 and set(times.tolist()) <= set(schedule)
    draws = {k: objective.noise(batch[k], 0, 1, 1) for k in range(4)}  # type: ignore[attr-defined]
    assert torch.equal(draws[0], draws[1]) and not torch.equal(draws[0], draws[2])  # shared by a group
    moved = objective.noise(replace(batch[0], advantage=0.0, sample_index=5), 0, 1, 1)  # type: ignore[attr-defined]
    assert torch.equal(moved, draws[0])
    assert not torch.equal(objective.noise(batch[0], 1, 1, 1), draws[0])  # type: ignore[attr-defined]
    assert not torch.equal(objective.noise(batch[0], 0, 1, 2), draws[0])  # type: ignore[attr-defined]
    own = dgpo_trainer(tiny, shared_noise=False).objective
    assert not torch.equal(own.noise(batch[0], 0, 1, 1), own.noise(batch[1], 0, 1, 1))  # type: ignore[attr-defined]


def test_the_old_policy_follows_the_reference_s_ema_and_becomes_what_rollouts_sample(tiny: Path) -> None:
    """After optimizer step k (0-based): old <- d old + (1 - d) current, d = min(rate k, max); the
    rollouts get the trained policy until more than sample_old_after optimizer steps are done."""
    step = dgpo_trainer(tiny, old_decay_rate=0.25, old_decay_max=0.5, sample_old_after=1)
    batch = clean_samples(tiny, ADVANTAGES)
    assert step.run(batch, PARAMS, seed=1, step=1)["actor/dgpo/old_decay"] == 0.0
    first = trainable(step)
    assert all(torch.equal(step.policy.old_state()[n], first[n]) for n in first)
    with step.sampling_policy():
        assert all(torch.equal(p, first[n]) for n, p in step.policy.trainable().items())  # the trained one
    assert step.run(batch, PARAMS, seed=1, step=2)["actor/dgpo/old_decay"] == 0.25
    second = trainable(step)
    for name, old in step.policy.old_state().items():
        torch.testing.assert_close(old, 0.25 * first[name] + 0.75 * second[name], rtol=0, atol=1e-7)
    with step.sampling_policy():
        sampled = trainable(step)
    assert all(torch.equal(sampled[n], step.policy.old_state()[n]) for n in sampled)
    assert not all(torch.equal(sampled[n], second[n]) for n in sampled)


def test_each_optimizer_step_refreshes_the_old_policy_before_the_next_mini_batch(tiny: Path) -> None:
    """Two mini-batches: two EMA steps in one training step, the second with d = rate x 1."""
    step = dgpo_trainer(tiny, mini_batches=2, old_decay_rate=0.25, old_decay_max=0.5)
    metrics = step.run(clean_samples(tiny, ADVANTAGES), PARAMS, seed=1, step=1)
    assert metrics["actor/dgpo/old_decay"] == 0.25 and step.optimizer_steps == 2
    assert step.objective.optimizer_steps == 2  # type: ignore[attr-defined]


def test_a_group_split_across_mini_batches_is_refused(tiny: Path) -> None:
    batch = clean_samples(tiny, ADVANTAGES)
    step = dgpo_trainer(tiny, mini_batches=2)
    with pytest.raises(ValueError, match="group p0 spans mini-batches 0 and 1"):
        step.run([batch[i] for i in (0, 2, 1, 3)], PARAMS, seed=1, step=1)
    assert step.optimizer_steps == 0


def test_a_guided_base_reference_and_the_kl_term(tiny: Path) -> None:
    """reference_cfg > 1: the frozen base's velocity is guided while the policy's is conditional,
    so they differ from the first step (the CFG-free recipe distils guidance); the KL is to it."""
    batch = clean_samples(tiny, ADVANTAGES)
    conditional = dgpo_trainer(tiny, kl_beta=0.02).run(batch, PARAMS, seed=1, step=1)
    assert conditional["actor/kl_loss"] == 0.0 and conditional["actor/dgpo/error_gap"] == 0.0
    guided = dgpo_trainer(tiny, kl_beta=0.02, reference_cfg=4.0).run(batch, PARAMS, seed=1, step=1)
    assert guided["actor/kl_loss"] > 0 and guided["actor/dgpo/error_gap"] != 0.0
    assert guided["actor/dgpo/weight"] != pytest.approx(0.5, abs=1e-9)


def test_the_old_policy_as_the_dpo_reference(tiny: Path) -> None:
    """reference=old (the reference's use_ema_ref): the DPO gap is to the old policy, which after a
    refresh with decay 0 is the trained one: the second step starts at weight 1/2 again."""
    batch = clean_samples(tiny, ADVANTAGES)
    step = dgpo_trainer(tiny, reference="old", old_decay_rate=0.0)
    step.run(batch, PARAMS, seed=1, step=1)
    metrics = step.run(batch, PARAMS, seed=1, step=2)
    assert metrics["actor/dgpo/error_gap"] == 0.0 and metrics["actor/dgpo/weight"] == pytest.approx(0.5)


def test_a_checkpoint_carries_the_old_policy_and_its_count(tiny: Path, tmp_path: Path) -> None:
    step = dgpo_trainer(tiny, mini_batches=2, old_decay_rate=0.5, old_decay_max=0.5, sample_old_after=1)
    step.run(clean_samples(tiny, ADVANTAGES), PARAMS, seed=1, step=1)
    path = save_checkpoint(tmp_path, step, step=1)
    assert path is not None
    resumed = dgpo_trainer(tiny, mini_batches=2, old_decay_rate=0.5, old_decay_max=0.5, sample_old_after=1)
    assert load_checkpoint(path, resumed) == 1
    assert resumed.objective.optimizer_steps == 2  # type: ignore[attr-defined]  # rollouts take the old
    for name, old in step.policy.old_state().items():
        assert torch.equal(resumed.policy.old_state()[name], old)
