"""Group advantages, torch-free: for each prompt's G rewards,
A = (r - mean_group) / (std_group + eps), clipped to +-clip; a group of one gets 0; the same A
for every trained step of the trajectory. Each algorithm makes its training targets of them
(``flowgrpo.algorithms``: DiffusionNFT's optimality in [0, 1])."""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import numpy as np

from flowgrpo.configs.run import AdvantageConfig


def group_advantages(
    rewards: Mapping[str, Sequence[float]], config: AdvantageConfig
) -> tuple[dict[str, list[float]], float]:
    """Advantages per group (same order as the rewards) and the share of groups whose rewards
    are all equal (``critic/rewards/zero_std_ratio``: they train nothing)."""
    every = np.concatenate([np.asarray(r, dtype=np.float64) for r in rewards.values()]) if rewards else None
    global_std = float(every.std(ddof=config.std_ddof)) if config.global_std and every is not None else None
    out: dict[str, list[float]] = {}
    zero_std = 0
    for uid, values in rewards.items():
        r = np.asarray(values, dtype=np.float64)
        if r.size < 2:
            out[uid] = [0.0] * r.size
            zero_std += 1
            continue
        std = float(r.std(ddof=config.std_ddof))
        zero_std += int(std == 0.0)
        scale = global_std if global_std is not None else std
        a = (r - r.mean()) / (scale + config.eps)
        out[uid] = np.clip(a, -config.clip, config.clip).tolist()
    return out, zero_std / max(len(rewards), 1)
