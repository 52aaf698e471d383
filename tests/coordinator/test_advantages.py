"""Group advantages against the formula written out by hand (SPEC section 3)."""

from __future__ import annotations

import numpy as np
import pytest

from flowgrpo.services.coordinator.advantages import group_advantages
from flowgrpo.services.coordinator.config import AdvantageConfig
from flowgrpo.services.coordinator.run import PromptOrder


def test_advantages_follow_the_formula_with_ddof_1_and_clip() -> None:
    rewards = {"a": [1.0, 2.0, 3.0, 10.0], "b": [0.5, 0.5, 0.5, 0.5], "c": [0.0]}
    out, zero_std = group_advantages(rewards, AdvantageConfig(std_ddof=1, eps=1e-4, clip=1.0))
    r = np.array(rewards["a"])
    expected = np.clip((r - r.mean()) / (r.std(ddof=1) + 1e-4), -1.0, 1.0)
    assert out["a"] == pytest.approx(expected.tolist(), abs=1e-12)
    assert out["a"][-1] == 1.0  # clipped: (10 - 4) / 4.08 > 1
    assert out["b"] == [0.0] * 4 and out["c"] == [0.0]  # equal rewards, and a group of one
    assert zero_std == pytest.approx(2 / 3)


def test_ddof_0_and_global_std() -> None:
    rewards = {"a": [0.0, 1.0], "b": [0.0, 3.0]}
    out, _ = group_advantages(rewards, AdvantageConfig(std_ddof=0, eps=0.0 + 1e-12, clip=100))
    assert out["a"] == pytest.approx([-1.0, 1.0]) and out["b"] == pytest.approx([-1.0, 1.0])
    scale = np.array([0.0, 1.0, 0.0, 3.0]).std()
    out, _ = group_advantages(rewards, AdvantageConfig(std_ddof=0, eps=1e-12, clip=100, global_std=True))
    assert out["b"] == pytest.approx([-1.5 / scale, 1.5 / scale])


def test_the_prompt_order_is_a_function_of_seed_and_cursor() -> None:
    order = PromptOrder(10, seed=3)
    first = [order[c] for c in range(25)]
    assert sorted(first[:10]) == list(range(10)) and sorted(first[10:20]) == list(range(10))
    assert first[:10] != first[10:20]  # a new permutation each epoch
    fresh = PromptOrder(10, seed=3)
    assert [fresh[c] for c in (24, 3, 17)] == [first[24], first[3], first[17]]  # random access
    assert [PromptOrder(10, seed=4)[c] for c in range(10)] != first[:10]
