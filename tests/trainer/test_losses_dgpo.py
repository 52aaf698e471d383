"""DGPO's loss against its equations written out in float64, its coefficients against autograd of
the group loss, the gradient's direction, and a group split over micro-batches (the trainer's
pre-pass) giving the unsplit gradient, which a per-micro-batch log-sigmoid does not."""

from __future__ import annotations

import math

import pytest
import torch
from torch import Tensor

from flowgrpo.algorithms.dgpo.loss import (
    denoising_error,
    dgpo_loss,
    gradient_clipped,
    group_logits,
    group_sums,
    sample_coefficients,
    surrogate_sum,
)

GROUP = torch.tensor([0, 0, 0, 1, 1])  # two prompt groups, of 3 and 2 samples
SIZES = torch.tensor([3.0, 2.0])
ADVANTAGES = torch.tensor([1.2, -0.3, -0.9, 0.7, -0.7], dtype=torch.float64)


def written_out_loss(error: list[list[float]], ref: list[list[float]], beta: float) -> float:
    """sum over groups g and times k of log(1 + exp(beta / G_g sum_{i in g} A_i (e_ik - e_ref_ik))),
    in plain Python floats (docs/algorithms.md, DGPO step 4)."""
    total = 0.0
    for g, size in enumerate(SIZES.tolist()):
        members = [i for i, x in enumerate(GROUP.tolist()) if x == g]
        for k in range(len(error[0])):
            margin = sum(float(ADVANTAGES[i]) * (error[i][k] - ref[i][k]) for i in members)
            total += math.log1p(math.exp(beta / size * margin))
    return total


def group_loss(error: Tensor, ref: Tensor, beta: float) -> Tensor:
    """The loss through the module's functions, summed over groups and times."""
    return dgpo_loss(group_logits(group_sums(ADVANTAGES, error, ref, GROUP, 2), SIZES, beta)).sum()


def random_errors(seed: int, times: int = 2) -> tuple[Tensor, Tensor]:
    g = torch.Generator().manual_seed(seed)
    ref = torch.rand(5, times, generator=g, dtype=torch.float64) + 0.5
    return ref + 0.01 * torch.randn(5, times, generator=g, dtype=torch.float64), ref


def test_the_denoising_error_is_the_velocity_target_s_mean_square() -> None:
    g = torch.Generator().manual_seed(0)
    v, x0, eps = (torch.randn(2, 3, 4, generator=g, dtype=torch.float64) for _ in range(3))
    expected = [
        sum((a - (e - x)) ** 2 for a, x, e in zip(v[i].flatten().tolist(), x0[i].flatten().tolist(),
                                                     eps[i].flatten().tolist(), strict=True)) / 12
        for i in range(2)
    ]  # fmt: skip
    assert denoising_error(v, x0, eps).tolist() == pytest.approx(expected, rel=1e-12)


@pytest.mark.parametrize("beta", [1.0, 100.0, 2000.0])
def test_the_group_loss_equals_the_equations_written_out(beta: float) -> None:
    error, ref = random_errors(1)
    expected = written_out_loss(error.tolist(), ref.tolist(), beta)
    assert float(group_loss(error, ref, beta)) == pytest.approx(expected, rel=1e-12)


def test_at_the_reference_every_group_weighs_one_half() -> None:
    """e = e_ref (the policy is the reference): s = 0, the loss is log 2 per (group, time)."""
    _, ref = random_errors(2)
    logits = group_logits(group_sums(ADVANTAGES, ref, ref, GROUP, 2), SIZES, 100.0)
    assert torch.equal(logits, torch.zeros(2, 2, dtype=torch.float64))
    assert float(dgpo_loss(logits).sum()) == pytest.approx(4 * math.log(2))


@pytest.mark.parametrize("beta", [1.0, 100.0])
def test_the_coefficients_are_the_group_loss_gradient_without_beta_over_g(beta: float) -> None:
    """dL / de_ik = sigmoid(s_gk) beta A_i / G_g; the coefficient is sigmoid(s_gk) A_i."""
    error, ref = random_errors(3)
    error.requires_grad_(True)
    group_loss(error, ref, beta).backward()
    assert error.grad is not None
    logits = group_logits(group_sums(ADVANTAGES, error.detach(), ref, GROUP, 2), SIZES, beta)[GROUP]
    coefficients = sample_coefficients(logits, ADVANTAGES, torch.zeros(5, 2, dtype=torch.bool))
    scale = (beta / SIZES.double()[GROUP]).view(-1, 1)
    torch.testing.assert_close(error.grad, coefficients * scale, rtol=1e-12, atol=0)


def test_the_clip_stops_a_sample_past_its_ratio_in_the_advantage_s_direction() -> None:
    """ratio = exp(e_old - e): a positive sample stops above 1 + c, a negative below 1 - c."""
    advantages = torch.tensor([1.0, 1.0, -1.0, -1.0, 0.0], dtype=torch.float64)
    old = torch.ones(5, dtype=torch.float64)
    error = torch.tensor([1 - 0.02, 1 - 0.005, 1 + 0.02, 1 + 0.005, 1 - 0.02], dtype=torch.float64)
    # ratios e^0.02 > 1.01, e^0.005 < 1.01, e^-0.02 < 0.99, e^-0.005 > 0.99; A = 0 counts as negative
    assert gradient_clipped(advantages, error, old, 0.01).tolist() == [True, False, True, False, False]
    clipped = gradient_clipped(advantages, error, old, 0.01)
    coefficients = sample_coefficients(torch.zeros(5, dtype=torch.float64), advantages, clipped)
    assert coefficients.tolist() == [0.0, 0.5, 0.0, -0.5, 0.0]
    assert not gradient_clipped(advantages, error, old, math.inf).any()


class ToyPolicy(torch.nn.Module):
    """v = x_t W: enough for denoising errors that depend on shared parameters."""

    def __init__(self) -> None:
        super().__init__()
        self.weight = torch.nn.Parameter(torch.eye(4, dtype=torch.float64) * 0.5)

    def errors(self, x0: Tensor, eps: Tensor, t: float) -> Tensor:
        x_t = (1 - t) * x0 + t * eps
        return denoising_error(x_t @ self.weight, x0, eps)


Batch = tuple[Tensor, Tensor, Tensor]  # x0, eps, reference errors


def toy_batch(seed: int = 4) -> Batch:
    """x0 [5, 6, 4]; one eps per group (shared noise), as the trainer draws it; reference errors."""
    g = torch.Generator().manual_seed(seed)
    x0 = torch.randn(5, 6, 4, generator=g, dtype=torch.float64)
    eps = torch.randn(2, 6, 4, generator=g, dtype=torch.float64)[GROUP]
    with torch.no_grad():
        ref = ToyPolicy().errors(x0, eps, 0.6) * (1 + 0.1 * torch.rand(5, generator=g, dtype=torch.float64))
    return x0, eps, ref


def unsplit_gradient(policy: ToyPolicy, batch: Batch, beta: float) -> Tensor:
    """Autograd of sum_g (G_g / beta) L_g: the loss whose gradient the coefficients scale to."""
    x0, eps, ref = batch
    policy.zero_grad()
    logits = group_logits(group_sums(ADVANTAGES, policy.errors(x0, eps, 0.6), ref, GROUP, 2), SIZES, beta)
    (dgpo_loss(logits) * SIZES.double() / beta).sum().backward()
    assert policy.weight.grad is not None
    return policy.weight.grad.clone()


def split_gradient(policy: ToyPolicy, batch: Batch, beta: float, size: int) -> Tensor:
    """The trainer's way: the groups' sums from every micro-batch without gradients, then each
    micro-batch's surrogate backward on its own, accumulating."""
    x0, eps, ref = batch
    policy.zero_grad()
    parts = [list(range(i, min(i + size, 5))) for i in range(0, 5, size)]
    with torch.no_grad():
        errors = [policy.errors(x0[p], eps[p], 0.6) for p in parts]
        sums = sum(
            group_sums(ADVANTAGES[p], e, ref[p], GROUP[p], 2) for p, e in zip(parts, errors, strict=True)
        )
    logits = group_logits(torch.as_tensor(sums), SIZES, beta)[GROUP]
    coefficients = sample_coefficients(logits, ADVANTAGES, torch.zeros(5, dtype=torch.bool))
    for p in parts:
        surrogate_sum(policy.errors(x0[p], eps[p], 0.6), coefficients[p], torch.ones(len(p))).backward()
    assert policy.weight.grad is not None
    return policy.weight.grad.clone()


@pytest.mark.parametrize("size", [1, 2, 4])
def test_a_group_split_across_micro_batches_gives_the_unsplit_gradient(size: int) -> None:
    batch = toy_batch()
    policy = ToyPolicy()
    unsplit = unsplit_gradient(policy, batch, 100.0)
    torch.testing.assert_close(split_gradient(policy, batch, 100.0, size), unsplit, rtol=1e-10, atol=0)


def test_a_log_sigmoid_per_micro_batch_would_not() -> None:
    """The control: each micro-batch's own partial group sum in its log-sigmoid is another gradient
    (so the test above can fail)."""
    batch = toy_batch()
    x0, eps, ref = batch
    policy = ToyPolicy()
    unsplit = unsplit_gradient(policy, batch, 100.0)
    policy.zero_grad()
    for p in ([0, 1], [2, 3], [4]):
        partial = group_sums(ADVANTAGES[p], policy.errors(x0[p], eps[p], 0.6), ref[p], GROUP[p], 2)
        (dgpo_loss(group_logits(partial, SIZES, 100.0)) * SIZES.double() / 100.0).sum().backward()
    assert policy.weight.grad is not None
    assert (policy.weight.grad - unsplit).abs().max() > 1e-3 * unsplit.abs().max()


def test_a_step_lowers_the_positive_samples_errors_and_raises_the_negatives() -> None:
    """Plain gradient descent on the surrogate: A > 0 samples are denoised better, A < 0 worse.
    One positive and one negative per group, each its own parameter (no cross-talk)."""
    g = torch.Generator().manual_seed(5)
    x0 = torch.randn(4, 6, 4, generator=g, dtype=torch.float64)
    eps = torch.randn(4, 6, 4, generator=g, dtype=torch.float64)
    advantages = torch.tensor([1.0, -1.0, 0.5, -0.5], dtype=torch.float64)
    group = torch.tensor([0, 0, 1, 1])
    policies = [ToyPolicy() for _ in range(4)]
    before = torch.stack([p.errors(x0[i : i + 1], eps[i : i + 1], 0.6)[0] for i, p in enumerate(policies)])
    ref = before.detach() * 1.01
    sums = group_sums(advantages, before.detach(), ref, group, 2)
    logits = group_logits(sums, torch.tensor([2.0, 2.0]), 100.0)
    coefficients = sample_coefficients(logits[group], advantages, torch.zeros(4, dtype=torch.bool))
    surrogate_sum(before, coefficients, torch.ones(4)).backward()
    with torch.no_grad():
        for p in policies:
            assert p.weight.grad is not None
            p.weight -= 1e-2 * p.weight.grad
        after = torch.stack([p.errors(x0[i : i + 1], eps[i : i + 1], 0.6)[0] for i, p in enumerate(policies)])
    assert torch.sign(after - before.detach()).tolist() == [-1.0, 1.0, -1.0, 1.0]
