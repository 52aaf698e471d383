"""The shared sampler math against oracles that do not restate it: definitions from first
principles (Gaussian densities, the flow's marginals, DDIM), worked numbers and properties (fp32;
tolerances stated per test)."""

from __future__ import annotations

import math

import pytest
import torch
from torch.distributions import Normal

from flowgrpo.sampler_math import (
    batch_noise,
    combine_cfg,
    cps_step,
    initial_noise,
    ode_step,
    sample_noise,
    sde_step,
    shifted_schedule,
    window_begin,
)
from flowgrpo.sampler_params import SamplerSettings

pytestmark = pytest.mark.bitwise  # tests/test_instruction_sets.py re-runs these on other ISAs


def test_shifted_schedule_points_and_steps() -> None:
    """The shift multiplies the noise-to-signal odds t / (1 - t) by 3 at every point (SD3's
    timestep shift); 15 points are 14 steps from 1 to 0, and the midpoint 0.5 lands on 0.75."""
    t = shifted_schedule(15, shift=3.0)
    assert t.shape == (15,) and t.dtype == torch.float32
    assert t[0] == 1.0 and t[-1] == 0.0 and bool((t[1:] < t[:-1]).all())
    assert t[7] == 0.75  # raw t = 7/14 = 0.5: odds 1 -> 3
    raw = [1 - i / 14 for i in range(1, 14)]
    odds = [float(s) / (1 - float(s)) for s in t[1:-1]]
    assert odds == pytest.approx([3 * r / (1 - r) for r in raw], rel=1e-5)
    with pytest.raises(ValueError, match="at least 2 points"):
        shifted_schedule(1)


def spec_scale(schedule: torch.Tensor, i: int, noise_level: float) -> float:
    """SPEC section 3's standard deviation of step i's Gaussian: std_t sqrt(-dt), std_t =
    a sqrt(sigma / (1 - s)) with s = sigma, except schedule[1] on the first step (sigma = 1)."""
    sigma, sigma_next = float(schedule[i]), float(schedule[i + 1])
    s = float(schedule[1]) if i == 0 else sigma
    return noise_level * math.sqrt(sigma / (1 - s)) * math.sqrt(sigma - sigma_next)


@pytest.mark.parametrize("i", [0, 2, 9, 13])
def test_sde_log_prob_at_the_sampled_point_is_minus_half_the_mean_square_noise(i: int) -> None:
    """x' = mean + scale eps gives -(x' - mean)^2 / (2 scale^2) = -eps^2 / 2 per element, averaged
    over the sample's elements, whatever the step; and the noise is drawn at SPEC's scale."""
    torch.manual_seed(0)
    x, v, eps = torch.randn(3, 8, 64), torch.randn(3, 8, 64), torch.randn(3, 8, 64)
    t = shifted_schedule(15)
    out = sde_step(x, v, t[i], t[i + 1], sigma_after_first=float(t[1]), noise_level=1.3, noise=eps)
    torch.testing.assert_close(out.x_next - out.mean, spec_scale(t, i, 1.3) * eps, rtol=1e-4, atol=1e-6)
    torch.testing.assert_close(out.log_prob, -(eps**2).mean(dim=(1, 2)) / 2, rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("i", [0, 4, 12])
def test_sde_log_prob_is_the_gaussian_density_without_its_normaliser(i: int) -> None:
    """Scoring any x' (not a sampled one): torch's Normal(mean, scale) log-density plus the terms
    the BAGEL reference drops, log(scale) + log(2 pi) / 2, averaged over elements (float64)."""
    torch.manual_seed(1)
    x, v, x_next = torch.randn(3, 8, 64), torch.randn(3, 8, 64), torch.randn(3, 8, 64)
    t = shifted_schedule(15)
    out = sde_step(x, v, t[i], t[i + 1], sigma_after_first=float(t[1]), noise_level=0.7, x_next=x_next)
    scale = spec_scale(t, i, 0.7)
    density = Normal(out.mean.double(), scale).log_prob(x_next.double())
    expected = (density + math.log(scale) + math.log(2 * math.pi) / 2).mean(dim=(1, 2))
    torch.testing.assert_close(out.log_prob.double(), expected, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("a", [0.7, 1.3])
def test_sde_step_keeps_the_marginals_of_the_flow(a: float) -> None:
    """From first principles, without the step's formula (a = noise_level): for data x0 ~ N(0, c^2) the flow's
    marginal at t is N(0, (1 - t)^2 c^2 + t^2) and the exact velocity E[eps - x0 | x_t = x] is
    (t - c^2 (1 - t)) x / var_t. A step that adds noise must correct its drift so the marginal of
    the next point is still the flow's (the FlowGRPO SDE): one Euler-Maruyama step of it from the
    marginal at sigma must land on the marginal at sigma' up to O(dt^2), the error falling 4x when
    dt halves; a wrong drift or noise scale leaves an O(dt) error (2x). Two values of c separate
    the coefficients of x and of v."""

    def marginal(t: float, c: float) -> float:
        return (1 - t) ** 2 * c**2 + t**2

    sigma, one = 0.6, torch.ones(1, 1, 1)
    for c in (0.5, 2.0):
        errors = []
        for dt in (0.04, 0.02, 0.01):
            k = (sigma - c**2 * (1 - sigma)) / marginal(sigma, c)  # v = k x
            step = sde_step(one, k * one, sigma, sigma - dt, sigma_after_first=0.9, noise_level=a, noise=one)
            gain = float(step.mean)  # x' = gain x + scale eps
            scale = float(step.x_next - step.mean)
            errors.append(gain**2 * marginal(sigma, c) + scale**2 - marginal(sigma - dt, c))
        assert errors[0] / errors[1] == pytest.approx(4, rel=0.05), (c, errors)
        assert errors[1] / errors[2] == pytest.approx(4, rel=0.05), (c, errors)


def test_first_step_uses_schedule_point_one() -> None:
    t = shifted_schedule(15)
    x, v, eps = torch.zeros(1, 2, 4), torch.ones(1, 2, 4), torch.zeros(1, 2, 4)
    out = sde_step(x, v, 1.0, float(t[1]), sigma_after_first=float(t[1]), noise_level=0.7, noise=eps)
    assert float(out.std) == pytest.approx(0.7 * math.sqrt(1.0 / (1.0 - float(t[1]))), rel=1e-6)


def test_scoring_a_stored_step_reproduces_the_sampled_log_prob() -> None:
    torch.manual_seed(1)
    x, v, eps = torch.randn(4, 8, 64), torch.randn(4, 8, 64), torch.randn(4, 8, 64)
    t = shifted_schedule(15)
    sampled = sde_step(x, v, t[4], t[5], sigma_after_first=float(t[1]), noise_level=1.3, noise=eps)
    scored = sde_step(x, v, t[4], t[5], sigma_after_first=float(t[1]), noise_level=1.3, x_next=sampled.x_next)
    assert torch.equal(scored.log_prob, sampled.log_prob)  # bitwise: same function, same inputs


def test_noise_level_zero_is_the_euler_ode() -> None:
    """The deterministic limit: the mean and the sample are x + v dt, and the step has no density."""
    torch.manual_seed(2)
    x, v, eps = torch.randn(2, 8, 64), torch.randn(2, 8, 64), torch.randn(2, 8, 64)
    out = sde_step(x, v, 0.8, 0.6, sigma_after_first=0.9, noise_level=0.0, noise=eps)
    euler = x + v * (0.6 - 0.8)
    torch.testing.assert_close(out.mean, euler, rtol=0, atol=1e-6)
    torch.testing.assert_close(out.x_next, euler, rtol=0, atol=1e-6)
    torch.testing.assert_close(ode_step(x, v, 0.8, 0.6), euler, rtol=0, atol=1e-6)
    assert torch.equal(out.log_prob, torch.zeros(2))


def test_cps_without_noise_is_ddim_which_is_the_euler_ode() -> None:
    """noise_level 0: s = 0 and the step is DDIM, (1 - sigma') x0_hat + sigma' x1_hat, which for
    a straight flow is exactly the Euler step x + v (sigma' - sigma)."""
    torch.manual_seed(3)
    x, v, eps = torch.randn(2, 4, 64), torch.randn(2, 4, 64), torch.randn(2, 4, 64)
    out = cps_step(x, v, 0.8, 0.7, noise_level=0.0, noise=eps)
    torch.testing.assert_close(out.x_next, x + v * (0.7 - 0.8), rtol=0, atol=1e-6)
    assert torch.equal(out.std, torch.zeros(2)) and torch.equal(out.log_prob, torch.zeros(2))


def test_cps_preserves_the_noise_coefficient_under_an_exact_model() -> None:
    """With an exact velocity (x = (1 - sigma) x0 + sigma x1, v = x1 - x0) the predictions are
    x0 and x1 themselves. noise_level 1/3 puts sin(pi / 6) = 1/2 of sigma' on fresh noise and
    sqrt(1 - 1/4) of it on x1, so x' = (1 - sigma') x0 + sigma' (sqrt(3)/2 x1 + 1/2 eps): the
    coefficients of the noises still add up to sigma' in quadrature. The log-prob is the
    references' -mean((x' - mean)^2), with no variance scaling."""
    torch.manual_seed(3)
    x0, x1, eps = torch.randn(2, 4, 64), torch.randn(2, 4, 64), torch.randn(2, 4, 64)
    sig, sig_next = 0.8, 0.7
    x, v = (1 - sig) * x0 + sig * x1, x1 - x0
    out = cps_step(x, v, sig, sig_next, noise_level=1 / 3, noise=eps)
    expected = (1 - sig_next) * x0 + sig_next * (math.sqrt(3) / 2 * x1 + eps / 2)
    torch.testing.assert_close(out.x_next, expected, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(out.std, torch.full((2,), sig_next / 2), rtol=1e-6, atol=0)
    torch.testing.assert_close(
        out.log_prob, -((sig_next / 2 * eps) ** 2).mean(dim=(1, 2)), rtol=1e-4, atol=1e-6
    )


@pytest.mark.parametrize("renorm", ["global", "channel", "text_channel"])
def test_renorm_never_raises_the_norm_above_the_conditional_one(renorm: str) -> None:
    torch.manual_seed(4)
    v_c, v_u = torch.randn(6, 16, 64), torch.randn(6, 16, 64)
    params = SamplerSettings(cfg_text_scale=4.0, cfg_renorm_type=renorm)  # type: ignore[arg-type]
    out = combine_cfg(v_c, v_u, torch.full((6,), 0.5), params)
    if renorm == "global":
        assert bool((out.flatten(1).norm(dim=1) <= v_c.flatten(1).norm(dim=1) * (1 + 1e-6)).all())
    else:
        assert bool((out.norm(dim=-1) <= v_c.norm(dim=-1) * (1 + 1e-6)).all())


def test_cfg_formula_and_per_sample_interval() -> None:
    torch.manual_seed(5)
    v_c, v_u = torch.randn(3, 4, 64), torch.randn(3, 4, 64)
    params = SamplerSettings(
        cfg_text_scale=4.0, cfg_interval=(0.4, 1.0), cfg_renorm_type="global", cfg_renorm_min=0.0
    )
    t = torch.tensor([0.9, 0.3, 0.5])  # sample 1 lies outside the interval, sample 0 inside
    out = combine_cfg(v_c, v_u, t, params)
    raw = v_u + 4.0 * (v_c - v_u)
    scale = (v_c.flatten(1).norm(dim=1) / (raw.flatten(1).norm(dim=1) + 1e-8)).clamp(0, 1).view(-1, 1, 1)
    torch.testing.assert_close(out[0], (raw * scale)[0], rtol=1e-6, atol=1e-6)
    assert torch.equal(out[1], v_c[1])
    torch.testing.assert_close(out[2], (raw * scale)[2], rtol=1e-6, atol=1e-6)


def test_img_scale_above_one_uses_the_image_branch() -> None:
    torch.manual_seed(6)
    v_c, v_u, v_i = torch.randn(2, 4, 8), torch.randn(2, 4, 8), torch.randn(2, 4, 8)
    params = SamplerSettings(
        cfg_text_scale=3.0, cfg_img_scale=1.5, cfg_renorm_type="global", cfg_renorm_min=1.0
    )
    out = combine_cfg(v_c, v_u, torch.ones(2), params, v_img_uncond=v_i)
    expected = v_i + 1.5 * ((v_u + 3.0 * (v_c - v_u)) - v_i)  # renorm_min 1 -> scale exactly 1
    torch.testing.assert_close(out, expected, rtol=1e-6, atol=1e-6)


def test_noise_is_a_pure_function_of_its_coordinates() -> None:
    base = {"seed": 7, "step": 3, "prompt_uid": "p1", "sample_index": 2, "stream": "init"}
    a = sample_noise((4, 64), **base)  # type: ignore[arg-type]
    assert torch.equal(a, sample_noise((4, 64), **base))  # type: ignore[arg-type]
    for key, value in [
        ("seed", 8),
        ("step", 4),
        ("prompt_uid", "p2"),
        ("sample_index", 3),
        ("stream", "sde/0"),
    ]:
        assert not torch.equal(a, sample_noise((4, 64), **{**base, key: value}))  # type: ignore[arg-type]
    keys = [("p1", 0), ("p1", 1), ("p2", 0)]
    full = batch_noise((4, 64), 7, 3, keys, "init")
    split = torch.cat(
        [batch_noise((4, 64), 7, 3, keys[:1], "init"), batch_noise((4, 64), 7, 3, keys[1:], "init")]
    )
    assert torch.equal(full, split)  # bitwise: batch composition does not change the draws


def test_initial_noise_is_the_samples_or_with_sharing_the_groups() -> None:
    """Unshared: the sample's own "init" draw. Shared (branched rollouts): one draw per (seed, step,
    prompt), the same for every sample index and unlike any sample's own; still standard normal."""
    coords = {"seed": 7, "step": 3, "prompt_uid": "p1"}
    own = [initial_noise((4, 64), **coords, sample_index=i, shared=False) for i in range(3)]  # type: ignore[arg-type]
    assert torch.equal(own[2], sample_noise((4, 64), **coords, sample_index=2, stream="init"))  # type: ignore[arg-type]
    group = [initial_noise((4, 64), **coords, sample_index=i, shared=True) for i in range(3)]  # type: ignore[arg-type]
    assert all(torch.equal(g, group[0]) for g in group)
    assert not any(torch.equal(group[0], o) for o in own)
    for key, value in [("seed", 8), ("step", 4), ("prompt_uid", "p2")]:
        other = initial_noise((4, 64), **{**coords, key: value}, sample_index=0, shared=True)  # type: ignore[arg-type]
        assert not torch.equal(group[0], other), key
    big = initial_noise((256, 64), **coords, sample_index=0, shared=True)  # type: ignore[arg-type]
    assert abs(float(big.mean())) < 0.02 and abs(float(big.std()) - 1.0) < 0.02  # 16384 draws: 5 sigma


def test_window_is_shared_by_a_group_and_moves_across_steps() -> None:
    params = SamplerSettings(num_points=15, window_size=2, window_range=(0, 7), window_strategy="random")
    begins = [window_begin(params, seed=0, step=s, prompt_uid="p1") for s in range(40)]
    assert all(0 <= b <= 5 for b in begins)
    assert len(set(begins)) == 6, "every admissible window start is used over 40 steps"
    assert window_begin(params, 0, 3, "p1") == window_begin(params, 0, 3, "p1")
    across_prompts = {window_begin(params, 0, 3, f"p{i}") for i in range(20)}
    assert len(across_prompts) > 1, "different groups of one step get different windows"
    fixed = SamplerSettings(num_points=15, window_size=2, window_range=(0, 7), window_strategy="fixed")
    assert len({window_begin(fixed, 0, s, f"p{s}") for s in range(20)}) == 1
    prog = SamplerSettings(num_points=15, window_size=3, window_range=(0, 7), window_strategy="progressive")
    assert [window_begin(prog, 0, s, "p") for s in range(6)] == [0, 1, 2, 3, 4, 0]
    with pytest.raises(ValueError, match="does not fit a schedule of 14 steps"):
        window_begin(SamplerSettings(num_points=15, window_size=2, window_range=(0, 15)), 0, 0, "p")
