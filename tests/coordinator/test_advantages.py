"""Group advantages against worked numbers and the defining property of a standardisation
(zero mean, unit std), not against the formula restated (SPEC section 3)."""

from __future__ import annotations

import math
from typing import Literal

import numpy as np
import pytest

from flowgrpo.configs.run import AdvantageConfig
from flowgrpo.services.coordinator.advantages import group_advantages
from flowgrpo.services.coordinator.run import PromptOrder


def test_advantages_follow_the_worked_example_with_ddof_1_and_clip() -> None:
    rewards = {"a": [1.0, 2.0, 3.0, 10.0], "b": [0.5, 0.5, 0.5, 0.5], "c": [0.0]}
    out, zero_std = group_advantages(rewards, AdvantageConfig(std_ddof=1, eps=1e-4, clip=1.0))
    # mean 4, deviations -3, -2, -1, 6: squares sum to 50, so std (ddof 1) = sqrt(50 / 3) ~ 4.08
    scale = math.sqrt(50 / 3) + 1e-4
    assert out["a"] == pytest.approx([-3 / scale, -2 / scale, -1 / scale, 1.0], abs=1e-12)  # 6 / 4.08 clipped
    assert out["b"] == [0.0] * 4 and out["c"] == [0.0]  # equal rewards, and a group of one
    assert zero_std == pytest.approx(2 / 3)


@pytest.mark.parametrize("ddof", [0, 1])
def test_unclipped_advantages_have_zero_mean_and_unit_std(ddof: Literal[0, 1]) -> None:
    rng = np.random.default_rng(0)
    rewards = {f"p{i}": rng.normal(i, 1 + i, size=16).tolist() for i in range(3)}
    out, zero_std = group_advantages(rewards, AdvantageConfig(std_ddof=ddof, eps=1e-12, clip=100))
    for uid, a in out.items():
        assert np.mean(a) == pytest.approx(0, abs=1e-12), uid
        assert np.std(a, ddof=ddof) == pytest.approx(1, rel=1e-9), uid
    assert zero_std == 0


def test_ddof_0_and_global_std() -> None:
    rewards = {"a": [0.0, 1.0], "b": [0.0, 3.0]}
    out, _ = group_advantages(rewards, AdvantageConfig(std_ddof=0, eps=1e-12, clip=100))
    assert out["a"] == pytest.approx([-1.0, 1.0]) and out["b"] == pytest.approx([-1.0, 1.0])
    # global: all four rewards 0, 1, 0, 3 have mean 1 and squared deviations 1 + 0 + 1 + 4 = 6,
    # so std (ddof 0) = sqrt(6 / 4); each group is still centred on its own mean
    out, _ = group_advantages(rewards, AdvantageConfig(std_ddof=0, eps=1e-12, clip=100, global_std=True))
    scale = math.sqrt(1.5)
    assert out["a"] == pytest.approx([-0.5 / scale, 0.5 / scale]) and out["b"] == pytest.approx(
        [-1.5 / scale, 1.5 / scale]
    )


def test_the_prompt_order_is_a_function_of_seed_and_step() -> None:
    order = PromptOrder(10, seed=3, per_step=5)
    first = [order.batch(step) for step in range(1, 6)]
    assert sorted(first[0] + first[1]) == list(range(10)) and sorted(first[2] + first[3]) == list(range(10))
    assert first[0] + first[1] != first[2] + first[3]  # a new permutation each epoch
    fresh = PromptOrder(10, seed=3, per_step=5)
    assert [fresh.batch(s) for s in (5, 1, 4)] == [first[4], first[0], first[3]]  # random access
    assert PromptOrder(10, seed=4, per_step=5).batch(1) != first[0]


def test_a_step_never_draws_a_prompt_twice_where_the_batch_does_not_divide_the_epoch() -> None:
    """16 of 243 prompts a step (the compose recipes): 15 whole batches an epoch, the 3 left over
    not drawn that epoch. Ran on into the next epoch, a batch held a prompt twice and the rollout
    refused the step (a run died at step 76)."""
    order = PromptOrder(243, seed=0, per_step=16)
    for step in range(1, 400):
        batch = order.batch(step)
        assert len(batch) == 16 and len(set(batch)) == 16, step
    epoch = [row for step in range(16, 31) for row in order.batch(step)]  # steps 16-30: epoch 1
    assert len(set(epoch)) == 240 and set(epoch) <= set(range(243))
    with pytest.raises(ValueError, match="prompts_per_step=11 with 10 training prompts"):
        PromptOrder(10, seed=0, per_step=11)
