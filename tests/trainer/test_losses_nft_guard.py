"""The DiffusionNFT and GRPO-Guard losses against reimplementations of their equations, the NFT
gradient against finite differences, and the properties each method rests on."""

from __future__ import annotations

import math
from dataclasses import replace

import pytest
import torch

from flowgrpo.algorithms.diffusion_nft.loss import (
    NftTargets,
    diffusion_nft_terms,
    implicit_velocities,
    velocity_kl,
)


def reference_loss(case: dict[str, torch.Tensor], i: int, *, beta: float, scale: float) -> float:
    """Sample i's loss in plain Python floats, written from the equations (docs/algorithms.md):
    v+ = beta v + (1 - beta) v_old, v- = (1 + beta) v_old - beta v, x0(u) = x_t - t u,
    L(u) = mean((x0(u) - x0)^2) / max(mean|x0(u) - x0|, 1e-5),
    loss = scale (r L(v+) + (1 - r) L(v-)) / beta."""
    v, v_old, x0, x_t = (case[k][i].flatten().tolist() for k in ("v", "v_old", "x0", "x_t"))
    t, r = float(case["t"][i]), float(case["r"][i])

    def adaptive(u: list[float]) -> float:
        errors = [xt - t * ui - x for xt, ui, x in zip(x_t, u, x0, strict=True)]
        mse = sum(e * e for e in errors) / len(errors)
        mae = max(sum(abs(e) for e in errors) / len(errors), 1e-5)
        return mse / mae

    v_pos = [beta * a + (1 - beta) * b for a, b in zip(v, v_old, strict=True)]
    v_neg = [(1 + beta) * b - beta * a for a, b in zip(v, v_old, strict=True)]
    return scale * (r * adaptive(v_pos) + (1 - r) * adaptive(v_neg)) / beta


def targets(
    case: dict[str, torch.Tensor], mask: torch.Tensor | None = None, rows: list[int] | None = None
) -> NftTargets:
    pick = (lambda x: x[rows]) if rows is not None else (lambda x: x)
    r = pick(case["r"])
    return NftTargets(
        pick(case["v_old"]),
        pick(case["x0"]),
        pick(case["x_t"]),
        pick(case["t"]),
        r,
        torch.ones_like(r) if mask is None else mask,
    )


def random_case(seed: int, b: int = 3, n: int = 4, c: int = 2) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    x0, eps = (
        torch.randn(b, n, c, generator=g, dtype=torch.float64),
        torch.randn(b, n, c, generator=g, dtype=torch.float64),
    )
    t = torch.rand(b, generator=g, dtype=torch.float64) * 0.9 + 0.05
    x_t = (1 - t.view(-1, 1, 1)) * x0 + t.view(-1, 1, 1) * eps
    v_old = eps - x0 + 0.3 * torch.randn(b, n, c, generator=g, dtype=torch.float64)
    v = v_old + 0.2 * torch.randn(b, n, c, generator=g, dtype=torch.float64)
    r = torch.rand(b, generator=g, dtype=torch.float64)
    return {"v": v, "v_old": v_old, "x0": x0, "x_t": x_t, "t": t, "r": r}


@pytest.mark.parametrize(("beta", "scale"), [(1.0, 5.0), (0.1, 5.0), (0.5, 1.0)])
def test_loss_equals_the_equations_written_out(beta: float, scale: float) -> None:
    case = random_case(0)
    terms = diffusion_nft_terms(case["v"], targets(case), beta=beta, scale=scale)
    expected = 0.0
    for i in range(3):
        expected += reference_loss(case, i, beta=beta, scale=scale)
    assert float(terms.loss_sum) == pytest.approx(expected, rel=1e-6)
    assert float(terms.count) == 3.0


def test_masked_rows_do_not_count() -> None:
    case = random_case(1)
    full = diffusion_nft_terms(case["v"], targets(case), beta=1.0, scale=5.0)
    masked = diffusion_nft_terms(case["v"], targets(case, torch.tensor([1.0, 0.0, 1.0])), beta=1.0, scale=5.0)
    first_and_last = diffusion_nft_terms(case["v"][[0, 2]], targets(case, rows=[0, 2]), beta=1.0, scale=5.0)
    assert float(masked.count) == 2.0 and float(full.count) == 3.0
    assert float(masked.loss_sum) == pytest.approx(float(first_and_last.loss_sum), rel=1e-12)


def test_gradient_matches_finite_differences() -> None:
    """d loss / d v by central differences (float64), the adaptive weights held fixed as the
    stop-gradient says: perturbing v moves the weight too, so the check recomputes the loss with
    the weights frozen at the unperturbed point."""
    case = random_case(2, b=2, n=3, c=2)
    v = case["v"].clone().requires_grad_(True)
    beta, scale = 0.5, 5.0
    terms = diffusion_nft_terms(v, targets(case), beta=beta, scale=scale)
    (grad,) = torch.autograd.grad(terms.loss_sum, v)

    times = case["t"].view(-1, 1, 1)

    def frozen_loss(u: torch.Tensor) -> float:
        pos, neg = implicit_velocities(u, case["v_old"], beta)
        base_pos, base_neg = implicit_velocities(case["v"], case["v_old"], beta)
        total = 0.0
        for current, base, weight in ((pos, base_pos, case["r"]), (neg, base_neg, 1 - case["r"])):
            err = case["x_t"] - times * current - case["x0"]
            mae = (case["x_t"] - times * base - case["x0"]).abs().flatten(1).mean(dim=1).clamp(min=1e-5)
            total += float((weight * (err**2).flatten(1).mean(dim=1) / mae).sum())
        return scale * total / beta

    h = 1e-6
    numeric = torch.zeros_like(grad)
    for index in range(v.numel()):
        step = torch.zeros(v.numel(), dtype=torch.float64)
        step[index] = h
        step = step.view_as(v)
        numeric.view(-1)[index] = (frozen_loss(case["v"] + step) - frozen_loss(case["v"] - step)) / (2 * h)
    torch.testing.assert_close(grad, numeric, rtol=1e-6, atol=1e-8)


def test_optimality_sets_the_direction() -> None:
    """At v = v_old (the first step after a refresh) the positive and negative losses are the
    same number, so the loss does not depend on r; its gradient does: r = 1 pulls x0(v) toward
    the clean image (v toward eps - x0), r = 0 pushes it away, r = 1/2 cancels exactly."""
    case = random_case(3, b=1)
    v = case["v_old"].clone()
    target = (case["x_t"] - case["x0"]) / case["t"].view(-1, 1, 1)  # the velocity whose x0 is exact
    grads = {}
    for r in (1.0, 0.5, 0.0):
        u = v.clone().requires_grad_(True)
        rows = replace(targets(case), optimality=torch.tensor([r], dtype=torch.float64))
        terms = diffusion_nft_terms(u, rows, beta=1.0, scale=1.0)
        grads[r] = torch.autograd.grad(terms.loss_sum, u)[0]
        assert float(terms.positive_sum) == pytest.approx(float(terms.negative_sum), rel=1e-12)
    toward = (target - v).flatten()
    assert float(-grads[1.0].flatten() @ toward) > 0  # a descent step moves v toward the target
    assert float(-grads[0.0].flatten() @ toward) < 0
    assert float(grads[0.5].abs().max()) < 1e-12


def test_kl_term_adds_beta_times_the_velocity_distance() -> None:
    case = random_case(4)
    v_ref = case["v_old"] * 0.5
    kl = velocity_kl(case["v"], v_ref)
    plain = diffusion_nft_terms(case["v"], targets(case), beta=1.0, scale=5.0)
    with_kl = diffusion_nft_terms(case["v"], targets(case), beta=1.0, scale=5.0, kl=kl, kl_beta=1e-2)
    assert torch.allclose(kl, ((case["v"] - v_ref) ** 2).mean(dim=(1, 2)))
    assert float(with_kl.loss_sum - plain.loss_sum) == pytest.approx(1e-2 * float(kl.sum()), rel=1e-9)
    assert float(with_kl.policy_loss_sum) == float(plain.policy_loss_sum)
    assert math.isfinite(float(plain.old_deviation_sum)) and float(plain.old_deviation_sum) > 0


# --- GRPO-Guard ------------------------------------------------------------------------------------


def guard_case(seed: int) -> dict[str, torch.Tensor]:
    """One SDE window step per row, scored under a moved mean (the current policy) and the
    proximal one: log-probs by the sampler's own function."""
    from flowgrpo.sampler_math import gaussian_log_prob

    g = torch.Generator().manual_seed(seed)
    b, n, c = 3, 5, 2
    mean_old = torch.randn(b, n, c, generator=g, dtype=torch.float64)
    std, dt = (
        torch.rand(b, generator=g, dtype=torch.float64) + 0.5,
        torch.rand(b, generator=g, dtype=torch.float64) * 0.2 + 0.05,
    )
    var = std**2 * dt
    x_next = mean_old + var.sqrt().view(-1, 1, 1) * torch.randn(b, n, c, generator=g, dtype=torch.float64)
    mean = mean_old + 0.05 * torch.randn(b, n, c, generator=g, dtype=torch.float64)
    return {
        "mean": mean,
        "mean_old": mean_old,
        "std": std,
        "dt": dt,
        "var": var,
        "x_next": x_next,
        "logp": gaussian_log_prob(x_next, mean, var),
        "logp_old": gaussian_log_prob(x_next, mean_old, var),
        "a": torch.tensor([1.0, -0.5, 2.0], dtype=torch.float64),
    }


def test_guard_ratio_is_the_mean_shift_free_normalised_ratio() -> None:
    """Written out: log p - log p_old = [2 mean(z d) - mean(d^2)] / (2 var) with z = x' - mean_old,
    d = mean - mean_old; adding b = mean(d^2) / (2 var) leaves mean(z d) / var, and the sqrt(var)
    factor mean(z d) / sqrt(var). The loss per entry is the clipped surrogate of that ratio / dt."""
    from flowgrpo.algorithms.grpo_guard.loss import GuardStep, grpo_guard_terms

    case = guard_case(0)
    drift = ((case["mean"] - case["mean_old"]) ** 2).flatten(1).mean(dim=1)
    terms = grpo_guard_terms(
        case["logp"],
        case["logp_old"],
        case["a"],
        torch.ones(3),
        step=GuardStep(drift, case["std"], case["dt"]),
        clip_eps=0.2,
    )
    z, d = case["x_next"] - case["mean_old"], case["mean"] - case["mean_old"]
    ratio = torch.exp((z * d).flatten(1).mean(dim=1) / case["var"].sqrt())
    expected = torch.maximum(-case["a"] * ratio, -case["a"] * ratio.clamp(0.8, 1.2)) / case["dt"]
    assert float(terms.loss_sum) == pytest.approx(float(expected.sum()), rel=1e-10)
    assert float(terms.ratio_sum) == pytest.approx(float(ratio.sum()), rel=1e-10)
    # at the proximal policy the ratio is exactly 1 (the plain ratio of one draw would be too, but
    # a moved mean no longer biases it low: its log is now linear in d, mean 0 over the noise)
    same = grpo_guard_terms(
        case["logp_old"],
        case["logp_old"],
        case["a"],
        torch.ones(3),
        step=GuardStep(torch.zeros(3, dtype=torch.float64), case["std"], case["dt"]),
        clip_eps=0.2,
    )
    assert float(same.ratio_sum) == 3.0
    assert float(same.loss_sum) == pytest.approx(float((-case["a"] / case["dt"]).sum()), rel=1e-12)
