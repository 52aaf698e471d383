"""The compose task's figures for ``flowgrpo bench algos`` (its docstring says what they mean):
each (algorithm, seed) pair's held-out accuracy over its lr = 0 control at every validation, the
rows over the seeds, and the sample-efficiency frontier against the reference algorithm."""

from __future__ import annotations

import itertools
import math
import statistics
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from flowgrpo.sampler_params import SamplerSettings
from flowgrpo.services.bench.learning import HELD_OUT_KEY, step_records, validations_of
from flowgrpo.services.bench.stats import Figure

GAIN_TOLERANCE = 1e-9  # points: far below one prompt of any held-out set (100 / 10^6)


@dataclass
class HeldOutCurve:
    """One (algorithm, seed) pair on the compose task, at each validation of the trained run."""

    algorithm: str
    seed: int
    steps: list[int]  # 0: before any update
    accuracy: list[float]  # held-out accuracy (a fraction)
    control: float  # the lr = 0 control's, the same at every step
    images: list[float]  # images generated before the validation
    trainer_s: list[float]  # trainer seconds before it
    rollout_s: list[float]

    @property
    def gain(self) -> list[float]:
        """Accuracy minus the control's, in points."""
        return [(a - self.control) * 100 for a in self.accuracy]

    @property
    def wall_s(self) -> list[float]:
        """Rollout plus trainer seconds before each validation."""
        return [r + t for r, t in zip(self.rollout_s, self.trainer_s, strict=True)]

    def reach(self, target: float, axis: list[float]) -> float:
        """``axis`` at the first validation whose gain is at least ``target`` points (inf: none).
        Gains are whole prompts over the held-out count, computed from other controls: the same
        number of prompts may differ in its last bits, so equal within 1e-9 points counts."""
        return next(
            (x for x, g in zip(axis, self.gain, strict=True) if g >= target - GAIN_TOLERANCE), math.inf
        )

    def stays(self, target: float, axis: list[float]) -> float:
        """``axis`` at the first validation from which every gain to the run's end is at least
        ``target`` (inf: the last is below): :meth:`reach` without the crossings that one
        validation's noise makes and the next takes back."""
        found = math.inf
        for x, g in reversed(list(zip(axis, self.gain, strict=True))):
            if g < target - GAIN_TOLERANCE:
                break
            found = x
        return found


def held_out_curve(
    algorithm: str, seed: int, trained_dir: Path, control: list[float], key: str = HELD_OUT_KEY
) -> HeldOutCurve:
    found = validations_of(trained_dir, key)
    if len(set(control)) != 1 or found.get(0) != control[0]:
        raise SystemExit(
            f"{algorithm} seed {seed}: the lr = 0 control's validations {control} must all equal the "
            f"trained run's step 0 ({found.get(0)}): the same weights, prompts and noise"
        )
    records = step_records(trained_dir)
    if [int(r["step"]) for r in records] != list(range(1, len(records) + 1)):
        raise SystemExit(f"{trained_dir}: the training steps are not 1..{len(records)}")

    def before(field: str) -> list[float]:  # the field's running total before each validation
        totals = [0.0, *itertools.accumulate(r[field] for r in records)]
        return [totals[step] for step in sorted(found)]

    return HeldOutCurve(
        algorithm,
        seed,
        steps=sorted(found),
        accuracy=[found[step] for step in sorted(found)],
        control=control[0],
        images=before("trainer/samples"),
        trainer_s=before("timing_s/train"),
        rollout_s=before("timing_s/gen"),
    )


@dataclass
class HeldOutRow:
    algorithm: str
    accuracy: Figure  # at the last validation, %
    control: Figure
    gain: Figure  # points
    peak: Figure  # the best validation's gain, points
    images_to_half: Figure  # to 50% of the best final gain (inf: not reached)
    images_to_most: Figure  # to 90%
    trainer_s_to_half: Figure
    trainer_s_to_most: Figure
    trainer_s: Figure  # the whole run's
    rollout_s: Figure
    images_to_target: Figure  # to the reference's final gain (inf: not reached)
    forwards_to_target: Figure  # the rollout's denoiser forwards to it
    wall_s_to_target: Figure  # rollout + trainer seconds to it
    fewer_images: Figure  # the reference's median images to the target / this run's
    images_to_stay: Figure  # to the first validation from which the gain stays at the target
    fewer_images_staying: Figure  # the same ratio with both counted so


def best_final_gain(curves: list[HeldOutCurve]) -> float:
    """The largest median (over the seeds) final gain of any algorithm, in points."""
    by_algorithm: dict[str, list[float]] = {}
    for c in curves:
        by_algorithm.setdefault(c.algorithm, []).append(c.gain[-1])
    return max(statistics.median(g) for g in by_algorithm.values())


@dataclass(frozen=True)
class Frontier:
    """What every algorithm is measured against: the reference's median final gain (points; inf
    where it is not above 0: nothing learnt, no target), the reference's median images to reach
    it, and each algorithm's denoiser forwards per image."""

    target: float
    reference_final_gain: float
    reference_images: float
    forwards_per_image: dict[str, float]
    reference_images_staying: float = math.inf  # its median images until it stays at the target


def frontier_of(curves: list[HeldOutCurve], reference: str, forwards_per_image: dict[str, float]) -> Frontier:
    ours = [c for c in curves if c.algorithm == reference]
    if not ours:
        raise SystemExit(f"--reference {reference} was not run: add it to --algorithms")
    final = statistics.median(c.gain[-1] for c in ours)
    target = final if final > 0 else math.inf  # a step-0 gain is 0: a target of 0 says nothing
    images = statistics.median(c.reach(target, c.images) for c in ours)
    staying = statistics.median(c.stays(target, c.images) for c in ours)
    return Frontier(target, final, images, forwards_per_image, staying)


def held_out_row(algorithm: str, curves: list[HeldOutCurve], best: float, frontier: Frontier) -> HeldOutRow:
    """``best``: :func:`best_final_gain`; at or below 0 nothing was learnt and nothing is reached."""
    half, most = (0.5 * best, 0.9 * best) if best > 0 else (math.inf, math.inf)
    target, per_image = frontier.target, frontier.forwards_per_image[algorithm]

    def fig(value: Callable[[HeldOutCurve], float], unit: str) -> Figure:
        return Figure.of([value(c) for c in curves], unit)

    return HeldOutRow(
        algorithm,
        accuracy=fig(lambda c: c.accuracy[-1] * 100, "%"),
        control=fig(lambda c: c.control * 100, "%"),
        gain=fig(lambda c: c.gain[-1], "points"),
        peak=fig(lambda c: max(c.gain), "points"),
        images_to_half=fig(lambda c: c.reach(half, c.images), "images"),
        images_to_most=fig(lambda c: c.reach(most, c.images), "images"),
        trainer_s_to_half=fig(lambda c: c.reach(half, c.trainer_s), "s"),
        trainer_s_to_most=fig(lambda c: c.reach(most, c.trainer_s), "s"),
        trainer_s=fig(lambda c: c.trainer_s[-1], "s"),
        rollout_s=fig(lambda c: c.rollout_s[-1], "s"),
        images_to_target=fig(lambda c: c.reach(target, c.images), "images"),
        forwards_to_target=fig(lambda c: c.reach(target, c.images) * per_image, "forwards"),
        wall_s_to_target=fig(lambda c: c.reach(target, c.wall_s), "s"),
        fewer_images=fig(lambda c: fewer(frontier.reference_images, c.reach(target, c.images)), "x"),
        images_to_stay=fig(lambda c: c.stays(target, c.images), "images"),
        fewer_images_staying=fig(
            lambda c: fewer(frontier.reference_images_staying, c.stays(target, c.images)), "x"
        ),
    )


def rollout_forwards_per_image(settings: SamplerSettings, group_size: int) -> float:
    """The denoiser forwards one training image costs the rollout: a row per CFG branch at each of
    the schedule's steps; with ``branch``, the group's steps before its window are computed once
    for the group: the expectation for a window beginning uniformly in [lo, hi - window_size] (the
    random strategy's draw per group, the progressive one's cycle; the fixed one's is the seed's)."""
    from flowgrpo.models.bagel.sampling import needs_uncond  # torch: only once runs are tabulated

    steps = settings.num_points - 1
    rows = 2 if needs_uncond(settings) else 1
    if not settings.branch:
        return float(rows * steps)
    lo, hi = settings.window_range
    starts = range(lo, hi - settings.window_size + 1)
    shared = statistics.fmean(starts) * (1 - 1 / group_size)  # the prefix, once per group
    return rows * (steps - shared)


def fewer(reference_images: float, images: float) -> float:
    """How many times fewer images than the reference: 0 where the run never reached the target,
    inf where its base already had (no image needed), NaN where the reference did not (no target)."""
    if math.isinf(reference_images):
        return math.nan
    return math.inf if images == 0 else reference_images / images


def fewer_cell(figure: Figure) -> str:
    """``3.0 (1.5-4.0)``; ``never`` for 0, ``at start`` for inf, ``n/a`` without a target."""

    def one(value: float) -> str:
        if math.isnan(value):
            return "n/a"
        return "never" if value == 0 else "at start" if math.isinf(value) else f"{value:.1f}"

    return f"{one(figure.median)} ({one(figure.min)}-{one(figure.max)})"


def reach_cell(figure: Figure, spec: str = ",.0f") -> str:
    """``1,280 (640-2,560)``; ``never`` where the median run did not reach it."""

    def one(value: float) -> str:
        return "never" if math.isinf(value) else format(value, spec)

    return f"{one(figure.median)} ({one(figure.min)}-{one(figure.max)})"


def print_held_out_table(rows: list[HeldOutRow], best: float, frontier: Frontier, reference: str) -> None:
    cells: list[tuple[str, int, Callable[[HeldOutRow], str]]] = [
        ("algorithm", 22, lambda r: r.algorithm),
        ("held-out accuracy %", 20, lambda r: r.accuracy.brief(".1f")),
        ("control %", 18, lambda r: r.control.brief(".1f")),
        ("gain (points)", 20, lambda r: r.gain.brief("+.1f")),
        ("peak gain", 20, lambda r: r.peak.brief("+.1f")),
        ("images to 50%", 22, lambda r: reach_cell(r.images_to_half)),
        ("images to 90%", 22, lambda r: reach_cell(r.images_to_most)),
        ("trainer s to 50%", 18, lambda r: reach_cell(r.trainer_s_to_half)),
        ("trainer s to 90%", 18, lambda r: reach_cell(r.trainer_s_to_most)),
        ("trainer s", 16, lambda r: r.trainer_s.brief(".0f")),
        ("rollout s", 16, lambda r: r.rollout_s.brief(".0f")),
        ("images to target", 22, lambda r: reach_cell(r.images_to_target)),
        ("x fewer images", 22, lambda r: fewer_cell(r.fewer_images)),
        ("forwards to target", 26, lambda r: reach_cell(r.forwards_to_target)),
        ("wall s to target", 18, lambda r: reach_cell(r.wall_s_to_target)),
        ("images to stay at target", 26, lambda r: reach_cell(r.images_to_stay)),
        ("x fewer, staying", 22, lambda r: fewer_cell(r.fewer_images_staying)),
    ]
    print(" ".join(f"{name:>{width}}" for name, width, _ in cells))
    for r in rows:
        print(" ".join(f"{cell(r):>{width}}" for _, width, cell in cells))
    print(f"median (min-max) over the seeds; best final gain {best:+.1f} points (50%: {best / 2:+.1f}, "
          f"90%: {0.9 * best:+.1f}); never: not reached by the last validation")  # fmt: skip
    if math.isinf(frontier.target):
        print(f"no target: {reference} ends {frontier.reference_final_gain:+.1f} points over its control "
              "(median over its seeds), nothing learnt to reach")  # fmt: skip
    else:
        print(f"target: {reference}'s final gain, {frontier.target:+.1f} points over its control (median "
              f"over its seeds), reached by it after {frontier.reference_images:,.0f} images, for good after "
              f"{frontier.reference_images_staying:,.0f}")  # fmt: skip
