"""One DiffusionNFT training step on a tiny BAGEL (CPU, fp32, deterministic shapes): the
optimality sets what the model learns, the old policy moves as the schedule says and is what is
published, the draws are a function of coordinates, and a checkpoint carries the old policy."""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

import pytest
import torch

from flowgrpo.configs.trainer import LossConfig, NftConfig, OptimConfig, PolicyConfig, TrainerConfig
from flowgrpo.models.bagel.checkpoint import load_bagel_model, load_special_tokens, make_tiny_bagel
from flowgrpo.models.bagel.sampling import BagelSampler, SampleRequest
from flowgrpo.sampler_params import SamplerParams
from flowgrpo.services.trainer.checkpoint import CheckpointError, load_checkpoint, save_checkpoint
from flowgrpo.services.trainer.policy import TrainablePolicy
from flowgrpo.services.trainer.step import TrainStep, Trajectory

# ODE rollouts (noise 0): NFT trains on clean latents only
PARAMS = SamplerParams(
    num_points=6,
    height=32,
    width=32,
    window_size=1,
    window_range=(0, 5),
    noise_level=0.0,
    cfg_text_scale=1.0,
    deterministic=True,
    decode_images=False,
)
PROMPTS = {"p0": [384, 5, 6, 7, 385], "p1": [384, 9, 10, 385]}
LORA = PolicyConfig(kind="lora", lora_rank=4, lora_alpha=8.0)


@pytest.fixture(scope="module")
def tiny(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_tiny_bagel(tmp_path_factory.mktemp("tiny"), seed=0)


def clean_samples(tiny: Path, optimality: list[float]) -> list[Trajectory]:
    sampler = BagelSampler(load_bagel_model(tiny, dtype=torch.float32), None, load_special_tokens(tiny))
    requests = [SampleRequest(uid, i, torch.tensor(ids)) for uid, ids in PROMPTS.items() for i in range(2)]
    out = sampler.generate(requests, PARAMS, seed=3, step=0)
    none = torch.empty(0)
    return [
        Trajectory(r.prompt_uid, r.sample_index, 0, a, r.prompt_ids, none, none, none, out.final_latents[i])
        for i, (r, a) in enumerate(zip(requests, optimality, strict=True))
    ]


def nft_trainer(tiny: Path, policy: PolicyConfig = LORA, mini_batches: int = 1, **nft: float) -> TrainStep:
    model = load_bagel_model(tiny, dtype=torch.float32)
    loss = LossConfig(mini_batches=mini_batches, micro_batch_size=1)
    config = NftConfig(**{"old_decay_rate": 0.0, **nft})  # type: ignore[arg-type]
    return TrainStep(
        TrainablePolicy(model, policy),
        load_special_tokens(tiny),
        TrainerConfig(algorithm=config, optim=OptimConfig(lr=1e-2), loss=loss),
    )


def denoising_error(step: TrainStep, sample: Trajectory, t: float = 0.6) -> float:
    """mean((x0(v) - x0)^2) of the policy at one fixed (t, eps): how well it predicts this x0."""
    assert sample.final_latents is not None
    eps = torch.randn(sample.final_latents.shape, generator=torch.Generator().manual_seed(7))
    x_t = (1 - t) * sample.final_latents + t * eps
    with torch.no_grad():
        v = step.forwards.velocity(
            step.forwards.context([sample], PARAMS), x_t[None], torch.tensor([t]), PARAMS
        )[0]
    return float(((x_t - t * v - sample.final_latents) ** 2).mean())


@pytest.mark.parametrize("policy", [LORA, PolicyConfig(kind="full")], ids=["lora", "full"])
def test_optimality_decides_which_images_the_model_learns_to_make(tiny: Path, policy: PolicyConfig) -> None:
    """r = 1 (positive): the step makes the model predict that clean latent better; r = 0: worse."""
    for r in (1.0, 0.0):
        batch = clean_samples(tiny, [r, 0.5, 0.5, 0.5])
        step = nft_trainer(tiny, policy)
        before = denoising_error(step, batch[0])
        metrics = step.run(batch, PARAMS, seed=1, step=1)
        after = denoising_error(step, batch[0])
        assert (after < before) if r == 1.0 else (after > before), (r, before, after)
        assert metrics["actor/grad_norm"] > 0 and metrics["actor/skipped_steps"] == 0
        assert step.version == 1 and metrics["trainer/lag/max"] == 0.0


def test_the_old_policy_follows_its_schedule_and_is_what_rollouts_get(tiny: Path) -> None:
    """decay d after step k: old <- d old + (1 - d) current; published = the old policy."""
    step = nft_trainer(tiny, old_decay_rate=0.25, old_decay_max=0.5)
    initial = {n: p.detach().clone() for n, p in step.policy.trainable().items()}
    batch = clean_samples(tiny, [1.0, 0.0, 0.75, 0.25])
    metrics = step.run(batch, PARAMS, seed=1, step=1)
    assert metrics["actor/nft/old_decay"] == 0.25
    current = {n: p.detach().clone() for n, p in step.policy.trainable().items()}
    for name, old in step.policy.old_state().items():
        torch.testing.assert_close(old, 0.25 * initial[name] + 0.75 * current[name], rtol=0, atol=1e-7)
    published_name = step.policy.published_name
    with step.sampling_policy():
        sampled = {n: t.clone() for n, t in step.policy.published().items()}
    trained = step.policy.published()
    moved = [n for n in trained if not torch.equal(trained[n], sampled[n])]
    assert moved, "the old policy should lag the trained one"
    for name, old in step.policy.old_state().items():
        assert torch.equal(sampled[published_name(name)], old)
    # the context restores the trained weights exactly
    assert all(torch.equal(p, current[n]) for n, p in step.policy.trainable().items())
    step.run(batch, PARAMS, seed=1, step=2)
    assert step.objective.nft.old_decay(2) == 0.5


def test_the_old_policy_decays_by_optimizer_steps_as_the_reference_counts_them(tiny: Path) -> None:
    """NVlabs' train_nft_sd3.py computes the decay from its global step, which counts gradient
    (optimizer) steps: with 2 mini-batches a training step is 2 of them, and the ramp is twice as
    fast as a count of training steps would make it."""
    step = nft_trainer(tiny, mini_batches=2, old_decay_rate=0.1, old_decay_max=0.9)
    batch = clean_samples(tiny, [1.0, 0.0, 0.5, 0.5])
    decays = [step.run(batch, PARAMS, seed=1, step=k)["actor/nft/old_decay"] for k in (1, 2)]
    assert decays == [2 * 0.1, 4 * 0.1] and step.optimizer_steps == 4 and step.steps_done == 2


def test_an_optimality_outside_0_1_trains_as_its_clamp(tiny: Path) -> None:
    """The reference clamps r to [0, 1]; a target outside it (the wire allows |r| <= 1e6) trains
    exactly as the clamped one."""
    wide, clamped = nft_trainer(tiny), nft_trainer(tiny)
    wide.run(clean_samples(tiny, [3.0, -2.0, 0.5, 0.5]), PARAMS, seed=1, step=1)
    clamped.run(clean_samples(tiny, [1.0, 0.0, 0.5, 0.5]), PARAMS, seed=1, step=1)
    for name, value in wide.policy.trainable().items():
        assert torch.equal(value, clamped.policy.trainable()[name]), name


def test_draws_depend_on_coordinates_not_on_the_batch(tiny: Path) -> None:
    """The times and noises of a sample are a function of (seed, step, prompt, sample): the same
    sample in another batch position, or alone, draws the same; another step draws others."""
    step = nft_trainer(tiny)
    batch = clean_samples(tiny, [1.0, 0.0, 0.5, 0.5])
    times, noises = step.objective.draw(batch[2], PARAMS, 1, 1)
    again = step.objective.draw(replace(batch[2], advantage=0.0), PARAMS, 1, 1)
    other_step = step.objective.draw(batch[2], PARAMS, 1, 2)
    assert torch.equal(times, again[0]) and torch.equal(noises, again[1])
    assert not torch.equal(noises, other_step[1])
    assert times.numel() == int(5 * 0.99) == 4 and len(set(times.tolist())) == 4


def test_a_step_is_reproducible_and_independent_of_batch_order(tiny: Path) -> None:
    """Deterministic mode, micro-batch 1: the same step twice gives bitwise the same weights; in
    another batch order, the same weights within float summation order (the gradient sums in
    another order; AdamW's first step moves each weight by about lr = 1e-2 whatever the gradient's
    size, so a rounding-level gradient difference shows as <= 1e-5 in a weight: 1e-3 of the step)."""
    batch = clean_samples(tiny, [1.0, 0.0, 0.75, 0.25])
    weights = []
    for order in ([0, 1, 2, 3], [0, 1, 2, 3], [3, 1, 0, 2]):
        step = nft_trainer(tiny)
        step.run([batch[i] for i in order], PARAMS, seed=1, step=1)
        weights.append({n: p.detach().clone() for n, p in step.policy.trainable().items()})
    assert all(torch.equal(weights[0][n], weights[1][n]) for n in weights[0])
    for n in weights[0]:
        torch.testing.assert_close(weights[2][n], weights[0][n], rtol=0, atol=1e-5)


def test_a_checkpoint_carries_the_old_policy(tiny: Path, tmp_path: Path) -> None:
    step = nft_trainer(tiny, mini_batches=2, old_decay_rate=0.5, old_decay_max=0.5)
    batch = clean_samples(tiny, [1.0, 0.0, 0.75, 0.25])
    step.run(batch, PARAMS, seed=1, step=1)
    path = save_checkpoint(tmp_path, step, step=1)
    assert path is not None
    resumed = nft_trainer(tiny, mini_batches=2, old_decay_rate=0.5, old_decay_max=0.5)
    assert load_checkpoint(path, resumed) == 1
    assert (resumed.version, resumed.steps_done, resumed.optimizer_steps) == (1, 1, 2)  # the decay's count
    for name, old in step.policy.old_state().items():
        assert torch.equal(resumed.policy.old_state()[name], old)
    flow_grpo = TrainStep(
        TrainablePolicy(load_bagel_model(tiny, dtype=torch.float32), LORA),
        load_special_tokens(tiny),
        TrainerConfig(optim=OptimConfig(), loss=LossConfig()),
    )
    with pytest.raises(CheckpointError, match="resume with the algorithm it was saved with"):
        load_checkpoint(path, flow_grpo)


def test_a_trainable_language_half_is_refused(tiny: Path) -> None:
    """The old, reference and current policies share one prefill per micro-batch: only right while
    the language half (which the prefill reads) is frozen, as every RL recipe has it."""
    model = load_bagel_model(tiny, dtype=torch.float32)
    policy = TrainablePolicy(model, PolicyConfig(kind="full", text=True))
    with pytest.raises(
        ValueError, match=r"language_model\.model\.embed_tokens\.weight \(the language half\)"
    ):
        TrainStep(
            policy,
            load_special_tokens(tiny),
            TrainerConfig(algorithm=NftConfig(), optim=OptimConfig(), loss=LossConfig()),
        )
