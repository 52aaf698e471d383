"""A reward as the weighted sum of several scorers, scored sample by sample.

Every image is checked once (uint8 [H, W, 3]) before any scorer sees it. A sample's reward is
``sum(weight * score)`` over the scorers; when one scorer fails for a sample, that sample has
no reward and its error names the scorer(s), while the scores the others gave are kept for
logging. Per-sample scores are keyed ``<scorer>`` and ``<scorer>/<extra>``; the coordinator
logs each as ``critic/<key>/mean`` (:func:`reward_metrics` does the same reduction here).
"""

from __future__ import annotations

import logging
import math
import time
from collections.abc import Sequence
from dataclasses import dataclass, field, replace

from flowgrpo.rewards.base import ErrorKind, Outcome, Sample, SampleError, SampleScore, Scorer
from flowgrpo.rewards.images import ImageError, check_image

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class Weighted:
    scorer: Scorer
    weight: float


@dataclass
class Scored:
    """The result of one sample: its reward (None when a scorer failed) and what each gave."""

    reward: float | None
    scores: dict[str, float] = field(default_factory=dict)
    errors: dict[str, SampleError] = field(default_factory=dict)  # scorer name (or "image") -> error

    @property
    def error(self) -> SampleError | None:
        """One error for the sample: the first kind, every scorer's message."""
        if not self.errors:
            return None
        kind: ErrorKind = next(iter(self.errors.values())).kind
        return SampleError(kind, "; ".join(f"{name}: {e.message}" for name, e in self.errors.items()))


@dataclass
class Batch:
    results: list[Scored]
    seconds: dict[str, float]  # scorer name -> wall time it took for this batch


class RewardModel:
    """The configured scorers and their weights; ``score`` runs them one after the other."""

    def __init__(self, parts: Sequence[Weighted]) -> None:
        names = [p.scorer.name for p in parts]
        if not parts or len(set(names)) != len(names):
            raise ValueError(f"a reward needs at least one scorer and unique names, got {names}")
        for part in parts:
            if not math.isfinite(part.weight):
                raise ValueError(f"scorer {part.scorer.name}: weight {part.weight} is not finite")
        self.parts = list(parts)

    @property
    def weights(self) -> dict[str, float]:
        return {p.scorer.name: p.weight for p in self.parts}

    def score(self, samples: Sequence[Sample]) -> Batch:
        results = [Scored(reward=None) for _ in samples]
        checked = {i: sample for i, s in enumerate(samples) if (sample := _checked(s, results[i]))}
        valid = list(checked)
        seconds = {}
        for part in self.parts:
            started = time.perf_counter()
            outcomes = run_scorer(part.scorer, list(checked.values()))
            seconds[part.scorer.name] = time.perf_counter() - started
            for i, outcome in zip(valid, outcomes, strict=True):
                _record(results[i], part.scorer.name, outcome)
        for result in results:
            if not result.errors:
                result.reward = sum(p.weight * result.scores[p.scorer.name] for p in self.parts)
        return Batch(results, seconds)

    def close(self) -> None:
        for part in self.parts:
            part.scorer.close()


def run_scorer(scorer: Scorer, samples: Sequence[Sample]) -> list[Outcome]:
    """``scorer.score(samples)``; a raise or a wrong count fails every sample, typed internal."""
    if not samples:
        return []
    try:
        outcomes = scorer.score(samples)
    except Exception as error:
        log.exception("scorer %s failed on a batch of %d", scorer.name, len(samples))
        return [SampleError("internal", f"{type(error).__name__}: {error} (traceback in the log)")] * len(
            samples
        )
    if len(outcomes) != len(samples):
        message = f"returned {len(outcomes)} outcomes for {len(samples)} samples (a scorer bug)"
        return [SampleError("internal", message)] * len(samples)
    return outcomes


def _checked(sample: Sample, result: Scored) -> Sample | None:
    """The sample with its image checked (and made contiguous), or None with the error recorded."""
    try:
        return replace(sample, image=check_image(sample.image))
    except ImageError as error:
        result.errors["image"] = SampleError("invalid_argument", str(error))
        return None


def _record(result: Scored, name: str, outcome: Outcome) -> None:
    if isinstance(outcome, SampleError):
        result.errors[name] = outcome
        return
    assert isinstance(outcome, SampleScore)
    result.scores[name] = outcome.value
    for extra, value in outcome.extras.items():
        result.scores[f"{name}/{extra}"] = value


def reward_metrics(results: Sequence[Scored]) -> dict[str, float]:
    """``critic/rewards/{mean,max,min}`` over the samples that have a reward, ``critic/<key>/mean``
    per score key, and ``reward/errors`` (the samples without a reward)."""
    rewards = [r.reward for r in results if r.reward is not None]
    metrics = {"reward/errors": float(len(results) - len(rewards))}
    if rewards:
        metrics |= {
            "critic/rewards/mean": sum(rewards) / len(rewards),
            "critic/rewards/max": max(rewards),
            "critic/rewards/min": min(rewards),
        }
    keys = dict.fromkeys(key for r in results for key in r.scores)
    for key in keys:
        values = [r.scores[key] for r in results if key in r.scores]
        metrics[f"critic/{key}/mean"] = sum(values) / len(values)
    return metrics
