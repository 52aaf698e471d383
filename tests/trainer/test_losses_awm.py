"""The Advantage Weighted Matching loss against its equations written out, its gradient against
finite differences, and the property the method rests on: the advantage's sign decides whether a
step fits the sample's clean latent better or worse."""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch

from flowgrpo.algorithms.awm.loss import AwmTargets, AwmTerms, awm_terms, matching_loss, velocity_distance


def random_case(seed: int, b: int = 3, n: int = 4, c: int = 2) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)

    def normal() -> torch.Tensor:
        return torch.randn(b, n, c, generator=g, dtype=torch.float64)

    x0, eps = normal(), normal()
    v = eps - x0 + 0.4 * normal()  # a velocity near the flow-matching target
    return {
        "v": v,
        "x0": x0,
        "eps": eps,
        "t": torch.rand(b, generator=g, dtype=torch.float64) * 0.9 + 0.05,
        "a": torch.rand(b, generator=g, dtype=torch.float64) * 2 - 1,
        "v_ref": v + 0.3 * normal(),
        "v_ema": v + 0.2 * normal(),
    }


def targets(case: dict[str, torch.Tensor], mask: torch.Tensor | None = None) -> AwmTargets:
    a = case["a"]
    return AwmTargets(case["x0"], case["eps"], case["t"], a, torch.ones_like(a) if mask is None else mask)


def reference_loss(
    case: dict[str, torch.Tensor], i: int, *, power: float, kl_beta: float, ema_kl_beta: float
) -> float:
    """Sample i's loss in plain Python floats, written from the equations (docs/algorithms.md):
    mse = mean((v - (eps - x0))^2), L = t ((mse + 1e-10)^p - (1e-10)^p) / p,
    loss = A L + kl_beta mean((v - v_ref)^2) + ema_kl_beta mean((v - v_ema)^2)."""
    v, x0, eps, v_ref, v_ema = (case[k][i].flatten().tolist() for k in ("v", "x0", "eps", "v_ref", "v_ema"))
    t, a = float(case["t"][i]), float(case["a"][i])
    mse = sum((vi - (e - x)) ** 2 for vi, e, x in zip(v, eps, x0, strict=True)) / len(v)
    matching = t * ((mse + 1e-10) ** power - 1e-10**power) / power
    kl = sum((vi - r) ** 2 for vi, r in zip(v, v_ref, strict=True)) / len(v)
    ema_kl = sum((vi - e) ** 2 for vi, e in zip(v, v_ema, strict=True)) / len(v)
    return a * matching + kl_beta * kl + ema_kl_beta * ema_kl


def with_advantage(case: dict[str, torch.Tensor], a: float) -> dict[str, torch.Tensor]:
    return {**case, "a": torch.full_like(case["a"], a)}


def terms_of(
    case: dict[str, torch.Tensor], v: torch.Tensor, power: float, kl_beta: float, ema: float
) -> AwmTerms:
    return awm_terms(
        v,
        targets(case),
        power=power,
        kl=velocity_distance(v, case["v_ref"]) if kl_beta > 0 else None,
        kl_beta=kl_beta,
        ema_kl=velocity_distance(v, case["v_ema"]) if ema > 0 else None,
        ema_kl_beta=ema,
    )


@pytest.mark.parametrize(
    ("power", "kl_beta", "ema"), [(0.25, 0.0, 0.0), (0.25, 3e-3, 1.0), (1.0, 1e-4, 0.0), (0.5, 0.0, 1.0)]
)
def test_loss_equals_the_equations_written_out(power: float, kl_beta: float, ema: float) -> None:
    case = random_case(0)
    terms = terms_of(case, case["v"], power, kl_beta, ema)
    expected = sum(reference_loss(case, i, power=power, kl_beta=kl_beta, ema_kl_beta=ema) for i in range(3))
    assert float(terms.loss_sum) == pytest.approx(expected, rel=1e-12)
    matching = [
        reference_loss(with_advantage(case, 1.0), i, power=power, kl_beta=0, ema_kl_beta=0) for i in range(3)
    ]
    assert float(terms.matching_sum) == pytest.approx(sum(matching), rel=1e-12)
    assert float(terms.count) == 3.0


def test_power_1_is_the_time_weighted_mse() -> None:
    """The reference's "t" weighting is the same family at p = 1: L = t mse."""
    case = random_case(1)
    mse = ((case["v"] - (case["eps"] - case["x0"])) ** 2).mean(dim=(1, 2))
    torch.testing.assert_close(
        matching_loss(case["v"], targets(case), 1.0), case["t"] * mse, rtol=1e-12, atol=0
    )


def test_masked_rows_do_not_count() -> None:
    case = random_case(2)
    masked = awm_terms(
        case["v"], targets(case, torch.tensor([1.0, 0.0, 1.0], dtype=torch.float64)), power=0.25
    )
    rows = {k: v[[0, 2]] for k, v in case.items()}
    first_and_last = awm_terms(rows["v"], targets(rows), power=0.25)
    assert float(masked.count) == 2.0
    assert float(masked.loss_sum) == pytest.approx(float(first_and_last.loss_sum), rel=1e-12)


def test_gradient_matches_finite_differences() -> None:
    """d loss / d v by central differences (float64), the KL pulls included."""
    case = random_case(3, b=2, n=3, c=2)
    v = case["v"].clone().requires_grad_(True)
    (grad,) = torch.autograd.grad(terms_of(case, v, 0.25, 3e-3, 1.0).loss_sum, v)

    def loss(u: torch.Tensor) -> float:
        return float(terms_of(case, u, 0.25, 3e-3, 1.0).loss_sum)

    h = 1e-6
    numeric = torch.zeros_like(grad)
    for index in range(v.numel()):
        step = torch.zeros(v.numel(), dtype=torch.float64)
        step[index] = h
        step = step.view_as(v)
        numeric.view(-1)[index] = (loss(case["v"] + step) - loss(case["v"] - step)) / (2 * h)
    torch.testing.assert_close(grad, numeric, rtol=1e-6, atol=1e-8)


def x0_error_after_a_step(case: dict[str, torch.Tensor], advantage: float) -> tuple[float, float]:
    """The error of the predicted clean latent x0(v) = x_t - t v before and after one small
    gradient-descent step on v (A for every sample)."""
    t = case["t"].view(-1, 1, 1)
    x_t = (1 - t) * case["x0"] + t * case["eps"]

    def error(u: torch.Tensor) -> float:
        return float(((x_t - t * u - case["x0"]) ** 2).sum())

    v = case["v"].clone().requires_grad_(True)
    rows = replace(targets(case), advantage=torch.full_like(case["a"], advantage))
    (grad,) = torch.autograd.grad(awm_terms(v, rows, power=0.25).loss_sum, v)
    return error(case["v"]), error(case["v"] - 1e-3 * grad)


def test_the_advantage_sign_sets_the_direction() -> None:
    """A > 0 pulls the predicted x0 toward the sample's x0, A < 0 pushes it away, A = 0 does nothing."""
    case = random_case(4)
    before, after = x0_error_after_a_step(case, 1.0)
    assert after < before
    before, after = x0_error_after_a_step(case, -1.0)
    assert after > before
    before, after = x0_error_after_a_step(case, 0.0)
    assert after == before
