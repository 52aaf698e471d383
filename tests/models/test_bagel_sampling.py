"""The BAGEL sampler on a tiny random checkpoint (CPU, fp32). Each test says whether it expects
bitwise equality or a tolerance."""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

import pytest
import torch

from flowgrpo.models.bagel.checkpoint import load_bagel_model, load_special_tokens, load_vae, make_tiny_bagel
from flowgrpo.models.bagel.model import latent_position_ids
from flowgrpo.models.bagel.sampling import (
    BagelSampler,
    SampleRequest,
    deterministic_kernels,
    guided_velocity,
    prefill_prompts,
    window_step,
    with_cfg_branches,
)
from flowgrpo.sampler_math import ode_step, sample_noise, shifted_schedule
from flowgrpo.sampler_params import SamplerParams

pytestmark = pytest.mark.bitwise  # tests/test_instruction_sets.py re-runs these on other ISAs

SEED, STEP = 11, 3
PARAMS = SamplerParams(num_points=9, height=64, width=64, window_size=2, window_range=(0, 5))


@pytest.fixture(scope="module")
def sampler(tmp_path_factory: pytest.TempPathFactory) -> BagelSampler:
    folder: Path = make_tiny_bagel(tmp_path_factory.mktemp("tiny"), seed=0)
    model = load_bagel_model(folder, dtype=torch.float32).eval()
    return BagelSampler(model, load_vae(folder, dtype=torch.float32), load_special_tokens(folder))


def requests(group: int = 2) -> list[SampleRequest]:
    """4 prompts of different lengths x ``group`` samples each."""
    g = torch.Generator().manual_seed(5)
    out = []
    for p, length in enumerate([3, 7, 5, 11]):
        ids = torch.randint(1, 380, (length,), generator=g)
        out += [SampleRequest(f"p{p}", s, ids) for s in range(group)]
    return out


def test_trajectory_shapes_and_images(sampler: BagelSampler) -> None:
    out = sampler.generate(requests(), PARAMS, seed=SEED, step=STEP)
    b, n = 8, 16
    assert out.latents.shape == (b, 3, n, 64) and out.log_probs.shape == (b, 2)
    assert out.sigmas.shape == (b, 3) and out.timesteps.shape == (b, 2)
    assert out.images is not None and out.images.shape == (b, 64, 64, 3) and out.images.dtype == torch.uint8
    schedule = shifted_schedule(9)
    for row in range(b):
        begin = int(out.window_begin[row])
        assert out.timesteps[row].tolist() == [begin, begin + 1]
        assert torch.equal(out.sigmas[row], schedule[begin : begin + 3])  # bitwise


def test_window_is_shared_by_a_group_and_changes_across_steps(sampler: BagelSampler) -> None:
    begins = {}
    for step in range(6):
        out = sampler.generate(requests(), replace(PARAMS, decode_images=False), seed=SEED, step=step)
        pairs = out.window_begin.view(4, 2)
        assert bool((pairs[:, 0] == pairs[:, 1]).all()), "the G samples of a group share the window"
        begins[step] = tuple(pairs[:, 0].tolist())
    assert len(set(begins.values())) > 1


def test_batch_composition_does_not_change_samples(sampler: BagelSampler) -> None:
    reqs = requests()
    det = replace(PARAMS, deterministic=True, decode_images=False)
    full = sampler.generate(reqs, det, seed=SEED, step=STEP)
    split = [sampler.generate(part, det, seed=SEED, step=STEP) for part in (reqs[5:], reqs[:5])]
    merged = torch.cat([split[1].latents, split[0].latents])
    assert torch.equal(full.latents, merged), "deterministic mode: bitwise whatever the split"
    assert torch.equal(full.log_probs, torch.cat([split[1].log_probs, split[0].log_probs]))
    batched = sampler.generate(reqs, replace(PARAMS, decode_images=False), seed=SEED, step=STEP)
    # batched mode pads prompts to the longest: equal within fp32 rounding
    torch.testing.assert_close(batched.latents, full.latents, atol=1e-4, rtol=1e-4)
    torch.testing.assert_close(batched.log_probs, full.log_probs, atol=1e-4, rtol=1e-4)


def test_stored_steps_rescore_to_the_behaviour_log_prob(sampler: BagelSampler) -> None:
    """What the trainer does in sync mode: recompute each window step's log-prob from the
    stored latents with the same velocity function; deterministic mode makes it bitwise."""
    reqs = requests(group=1)
    params = replace(PARAMS, deterministic=True, decode_images=False)
    out = sampler.generate(reqs, params, seed=SEED, step=STEP)
    model, special = sampler.model, sampler.special
    pos = latent_position_ids(4, 4, model.config.max_latent_size)
    schedule = shifted_schedule(params.num_points)
    for row, req in enumerate(reqs):
        with deterministic_kernels():  # the sampler's deterministic mode: same kernels, one thread
            cache = with_cfg_branches(model, prefill_prompts(model, [req.prompt_ids]), params)
        for k in range(params.window_size):
            x, x_next = out.latents[row : row + 1, k], out.latents[row : row + 1, k + 1]
            sig, sig_next = out.sigmas[row : row + 1, k], out.sigmas[row : row + 1, k + 1]
            with torch.no_grad(), deterministic_kernels():
                v = guided_velocity(model, cache, x, sig, pos, params=params, special=special)
            scored = window_step(
                params, x, v, sig, sig_next, sigma_after_first=float(schedule[1]), x_next=x_next
            )
            assert torch.equal(scored.log_prob, out.log_probs[row : row + 1, k])
            # and the stored x_next is that Gaussian's mean plus the coordinate-keyed noise
            step_index = int(out.timesteps[row, k])
            eps = sample_noise((16, 64), seed=SEED, step=STEP, prompt_uid=req.prompt_uid, sample_index=0,
                               stream=f"sde/{step_index}")  # fmt: skip
            sampled = window_step(
                params, x, v, sig, sig_next, sigma_after_first=float(schedule[1]), noise=eps[None]
            )
            assert torch.equal(sampled.x_next, x_next)


def test_noise_level_zero_is_the_euler_ode(sampler: BagelSampler) -> None:
    reqs = requests(group=1)[:2]
    params = replace(PARAMS, noise_level=0.0, deterministic=True, decode_images=False)
    out = sampler.generate(reqs, params, seed=SEED, step=STEP)
    assert torch.equal(out.log_probs, torch.zeros_like(out.log_probs))
    model, special = sampler.model, sampler.special
    pos = latent_position_ids(4, 4, model.config.max_latent_size)
    schedule = shifted_schedule(params.num_points)
    for row, req in enumerate(reqs):
        x = sample_noise(
            (16, 64), seed=SEED, step=STEP, prompt_uid=req.prompt_uid, sample_index=0, stream="init"
        )[None]
        with torch.no_grad(), deterministic_kernels():
            cache = with_cfg_branches(model, prefill_prompts(model, [req.prompt_ids]), params)
            for i in range(params.num_steps):
                v = guided_velocity(model, cache, x, schedule[i : i + 1], pos, params=params, special=special)
                x = ode_step(x, v, schedule[i], schedule[i + 1])
        assert torch.equal(out.final_latents[row : row + 1], x)  # bitwise: the same Euler loop


def test_seed_and_step_change_the_samples(sampler: BagelSampler) -> None:
    reqs = requests(group=2)[:2]
    params = replace(PARAMS, decode_images=False)
    a = sampler.generate(reqs, params, seed=SEED, step=STEP).final_latents
    assert not torch.equal(a[0], a[1]), "two samples of one group differ"
    assert not torch.equal(a, sampler.generate(reqs, params, seed=SEED + 1, step=STEP).final_latents)
    assert not torch.equal(a, sampler.generate(reqs, params, seed=SEED, step=STEP + 1).final_latents)


def test_bad_inputs_are_refused(sampler: BagelSampler) -> None:
    with pytest.raises(ValueError, match="multiple of 16"):
        sampler.generate(requests(), replace(PARAMS, height=60), seed=0, step=0)
    with pytest.raises(ValueError, match="does not fit a schedule of 8 steps"):
        sampler.generate(requests(), replace(PARAMS, window_size=2, window_range=(0, 9)), seed=0, step=0)
    twisted = [SampleRequest("p0", 0, torch.tensor([1, 2])), SampleRequest("p0", 1, torch.tensor([1, 3]))]
    with pytest.raises(ValueError, match="two different token sequences"):
        sampler.generate(twisted, PARAMS, seed=0, step=0)


def test_overlapping_deterministic_contexts_restore_the_settings() -> None:
    """The in-process launcher's rollout and trainer threads enter and leave deterministic mode
    interleaved (A in, B in, A out, B out): the settings stay on while either is inside and come
    back to what they were when the last leaves."""
    import threading

    from flowgrpo.models.bagel.sampling import deterministic_kernels

    before = torch.are_deterministic_algorithms_enabled(), torch.get_num_threads()
    a_in, b_in, a_out = threading.Event(), threading.Event(), threading.Event()
    seen: list[bool] = []

    def first() -> None:
        with deterministic_kernels():
            a_in.set()
            b_in.wait(10)
        a_out.set()

    def second() -> None:
        a_in.wait(10)
        with deterministic_kernels():
            b_in.set()
            a_out.wait(10)
            seen.append(torch.are_deterministic_algorithms_enabled())  # A has left, B is inside

    threads = [threading.Thread(target=first), threading.Thread(target=second)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(20)
    assert seen == [True]
    assert (torch.are_deterministic_algorithms_enabled(), torch.get_num_threads()) == before


def test_batch_invariant_samples_do_not_depend_on_their_batch(sampler: BagelSampler) -> None:
    """``batch_invariant``: a sample drawn beside 7 others (prompts of 3-11 tokens) equals, bitwise,
    the same sample drawn alone or beside others in another order, with every thread on; the
    plain batched path parts from the lone sample at float rounding (the control)."""
    params = replace(PARAMS, batch_invariant=True, decode_images=False)
    everything = requests()
    full = sampler.generate(everything, params, seed=SEED, step=STEP)
    reordered = sampler.generate(everything[::-1], params, seed=SEED, step=STEP)
    for i, request in enumerate(everything):
        alone = sampler.generate([request], params, seed=SEED, step=STEP)
        assert torch.equal(full.latents[i], alone.latents[0]), request
        assert torch.equal(full.log_probs[i], alone.log_probs[0]), request
        assert torch.equal(reordered.log_probs[len(everything) - 1 - i], alone.log_probs[0]), request
    plain = replace(params, batch_invariant=False)
    batched = sampler.generate(everything, plain, seed=SEED, step=STEP)
    lone = [sampler.generate([r], plain, seed=SEED, step=STEP).latents[0] for r in everything]
    assert not all(torch.equal(batched.latents[i], lone[i]) for i in range(len(everything)))


def test_batch_invariant_window_step_scores_each_row_alone() -> None:
    """``batch_invariant``: the window step of a batch is, bitwise, each row's step computed alone
    (a GPU reduction picks its summation order from the number of rows; a row alone has one), in
    both directions (sampling with noise, scoring a stored x_next), and it agrees with the batched
    step within rounding."""
    g = torch.Generator().manual_seed(0)
    x, v, noise = (torch.randn(5, 16, 8, generator=g) for _ in range(3))
    sigma, sigma_next = torch.full((5,), 0.8), torch.full((5,), 0.7)
    for sde_type in ("sde", "cps"):
        params = replace(PARAMS, batch_invariant=True, sde_type=sde_type)
        drawn = window_step(params, x, v, sigma, sigma_next, sigma_after_first=0.9, noise=noise)
        scored = window_step(params, x, v, sigma, sigma_next, sigma_after_first=0.9, x_next=drawn.x_next)
        batched = window_step(replace(params, batch_invariant=False), x, v, sigma, sigma_next,
                              sigma_after_first=0.9, x_next=drawn.x_next)  # fmt: skip
        for i in range(5):
            alone = window_step(params, x[i : i + 1], v[i : i + 1], sigma[i : i + 1], sigma_next[i : i + 1],
                                sigma_after_first=0.9, x_next=drawn.x_next[i : i + 1])  # fmt: skip
            assert torch.equal(scored.log_prob[i : i + 1], alone.log_prob), (sde_type, i)
            assert torch.equal(scored.mean[i : i + 1], alone.mean), (sde_type, i)
        assert torch.equal(drawn.log_prob, scored.log_prob)
        torch.testing.assert_close(batched.log_prob, scored.log_prob, rtol=1e-6, atol=1e-6)
