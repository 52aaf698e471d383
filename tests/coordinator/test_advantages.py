"""Group advantages against worked numbers and the defining property of a standardisation
(zero mean, unit std), not against the formula restated (SPEC section 3)."""

from __future__ import annotations

import math
from typing import Literal

import numpy as np
import pytest

from flowgrpo.services.coordinator.advantages import group_advantages
from flowgrpo.services.coordinator.config import AdvantageConfig
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


def test_the_prompt_order_is_a_function_of_seed_and_cursor() -> None:
    order = PromptOrder(10, seed=3)
    first = [order[c] for c in range(25)]
    assert sorted(first[:10]) == list(range(10)) and sorted(first[10:20]) == list(range(10))
    assert first[:10] != first[10:20]  # a new permutation each epoch
    fresh = PromptOrder(10, seed=3)
    assert [fresh[c] for c in (24, 3, 17)] == [first[24], first[3], first[17]]  # random access
    assert [PromptOrder(10, seed=4)[c] for c in range(10)] != first[:10]
