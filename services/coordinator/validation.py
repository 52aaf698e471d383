"""What a validation logs: the held-out scores of its samples as ``val-core`` / ``val-aux``
metrics, by scorer (the coordinator's ``validate`` samples and scores them)."""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import TYPE_CHECKING

import numpy as np

from flowgrpo.rewards.config import ScorerSpec

if TYPE_CHECKING:
    from flowgrpo.services.coordinator.run import Group


def validation_metrics(
    groups: list[Group], scorers: Sequence[ScorerSpec], samples: int = 1
) -> dict[str, float]:
    """``val-core/<scorer>/reward/mean@1`` per scorer (its own score, unweighted: what it measures)
    and ``val-aux/<scorer>/<detail>/mean@1`` for the details a scorer reports beside its score;
    ``val-core/total/reward/mean@1`` (the weighted sum that is trained on) when it differs from
    the one scorer's score. Keyed by scorer, not data source: the data set does not say what was
    scored. A scorer with no result anywhere logs NaN, so a missing curve is a visible gap.
    mean@1 is over each prompt's first sample; with ``samples`` (N) > 1 per prompt the same keys
    with mean@N are over all of them (verl's meaning of mean@N)."""
    metrics = _means(groups, scorers, 1)
    return metrics | (_means(groups, scorers, samples) if samples > 1 else {})


def _means(groups: list[Group], scorers: Sequence[ScorerSpec], first: int) -> dict[str, float]:
    """:func:`validation_metrics`' mean@``first``: over the first ``first`` samples of each prompt."""
    scores = [s for g in groups if g.rewards for s in g.scores[:first]]
    metrics: dict[str, float] = {}
    for key in sorted({k for s in scores for k in s} | {spec.name for spec in scorers}):
        values = [s[key] for s in scores if key in s]
        name = f"val-core/{key}/reward/mean@{first}" if "/" not in key else f"val-aux/{key}/mean@{first}"
        metrics[name] = float(np.mean(values)) if values else math.nan
    if _weighted(scorers):
        totals = [r for g in groups for r in g.rewards[:first]]
        metrics[f"val-core/total/reward/mean@{first}"] = float(np.mean(totals)) if totals else math.nan
    return metrics


def validation_keys(scorers: Sequence[ScorerSpec]) -> list[str]:
    """The ``val-core`` keys every validation logs (:func:`validation_metrics`), known before it."""
    return [f"val-core/{s.name}/reward/mean@1" for s in scorers] + (
        ["val-core/total/reward/mean@1"] if _weighted(scorers) else []
    )


def _weighted(scorers: Sequence[ScorerSpec]) -> bool:
    """Whether the reward trained on differs from the one scorer's own score."""
    return len(scorers) > 1 or any(spec.weight != 1.0 for spec in scorers)
