"""The shared sampler math against its formulas (fp32; tolerances stated per test)."""

from __future__ import annotations

import math

import pytest
import torch

from flowgrpo.sampler_math import (
    batch_noise,
    combine_cfg,
    cps_step,
    ode_step,
    sample_noise,
    sde_step,
    shifted_schedule,
    window_begin,
)
from flowgrpo.sampler_params import SamplerSettings


def test_shifted_schedule_points_and_steps() -> None:
    t = shifted_schedule(15, shift=3.0)
    assert t.shape == (15,) and t.dtype == torch.float32  # 15 points -> 14 steps
    raw = torch.linspace(1, 0, 15, dtype=torch.float64)
    torch.testing.assert_close(t, (3 * raw / (1 + 2 * raw)).float(), rtol=0, atol=0)
    assert t[0] == 1.0 and t[-1] == 0.0 and bool((t[1:] < t[:-1]).all())
    with pytest.raises(ValueError, match="at least 2 points"):
        shifted_schedule(1)


def test_sde_step_matches_the_closed_form() -> None:
    torch.manual_seed(0)
    x, v, eps = torch.randn(3, 8, 64), torch.randn(3, 8, 64), torch.randn(3, 8, 64)
    t = shifted_schedule(15)
    a, sig, sig_next, s1 = 1.3, float(t[2]), float(t[3]), float(t[1])
    out = sde_step(x, v, sig, sig_next, sigma_after_first=s1, noise_level=a, noise=eps)
    std = a * math.sqrt(sig / (1 - sig))
    dt = sig_next - sig
    mean = x * (1 + std**2 * dt / (2 * sig)) + v * (1 + std**2 * (1 - sig) / (2 * sig)) * dt
    x_next = mean + std * math.sqrt(-dt) * eps
    lp = (-((x_next - mean) ** 2) / (2 * std**2 * -dt)).mean(dim=(1, 2))
    torch.testing.assert_close(out.mean, mean, rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(out.x_next, x_next, rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(out.log_prob, lp, rtol=1e-6, atol=1e-6)
    # the log-prob of a sampled step is -E[eps^2]/2 per element: the closed-form Gaussian term
    torch.testing.assert_close(out.log_prob, -(eps**2).mean(dim=(1, 2)) / 2, rtol=1e-4, atol=1e-5)


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
    torch.manual_seed(2)
    x, v, eps = torch.randn(2, 8, 64), torch.randn(2, 8, 64), torch.randn(2, 8, 64)
    out = sde_step(x, v, 0.8, 0.6, sigma_after_first=0.9, noise_level=0.0, noise=eps)
    torch.testing.assert_close(out.x_next, ode_step(x, v, 0.8, 0.6), rtol=0, atol=1e-7)
    assert torch.equal(out.log_prob, torch.zeros(2))


def test_cps_step_formula() -> None:
    torch.manual_seed(3)
    x, v, eps = torch.randn(2, 4, 64), torch.randn(2, 4, 64), torch.randn(2, 4, 64)
    sig, sig_next, a = 0.8, 0.7, 0.8
    out = cps_step(x, v, sig, sig_next, noise_level=a, noise=eps)
    s = sig_next * math.sin(a * math.pi / 2)
    mean = (1 - sig_next) * (x - sig * v) + math.sqrt(sig_next**2 - s**2) * (x + (1 - sig) * v)
    torch.testing.assert_close(out.mean, mean, rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(out.x_next, mean + s * eps, rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(out.log_prob, -((s * eps) ** 2).mean(dim=(1, 2)), rtol=1e-5, atol=1e-6)


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
