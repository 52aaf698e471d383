"""The renderer: a deterministic function of (spec, seed) that draws many layouts, each with
exactly the prompt's blobs, sized, placed and spaced by the documented margins."""

from __future__ import annotations

import itertools
import math

import numpy as np
import pytest

from flowgrpo.compose.grammar import (
    COLOURS,
    Attribution,
    Blob,
    Counting,
    Position,
    Relation,
    Single,
    Spec,
    all_specs,
    blobs_of,
    parse,
    prompt_of,
)
from flowgrpo.compose.palette import BACKGROUND, PALETTE
from flowgrpo.compose.render import Disc, layout, paint, render

SEEDS = range(3)


def _layouts() -> list[tuple[Spec, tuple[Disc, ...]]]:
    return [
        (s, layout(s, np.random.default_rng([seed, i]))) for i, s in enumerate(all_specs()) for seed in SEEDS
    ]


def test_a_layout_holds_exactly_the_prompts_blobs_inside_the_image_and_apart() -> None:
    for spec, discs in _layouts():
        assert sorted(d.colour for d in discs) == sorted(b.colour for b in blobs_of(spec)), spec
        for d in discs:
            assert 2 <= d.x - d.radius <= d.x + d.radius <= 62, (spec, d)  # 2 px border
            assert 2 <= d.y - d.radius <= d.y + d.radius <= 62, (spec, d)
            assert 9 <= d.diameter <= 22, (spec, d)
        for a, b in itertools.combinations(discs, 2):
            gap = math.hypot(a.x - b.x, a.y - b.y) - a.radius - b.radius
            assert gap >= (16 if a.colour == b.colour else 6), (spec, a, b)


def test_sizes_sides_and_directions_are_drawn_with_margins() -> None:
    for spec, discs in _layouts():
        by_colour = {d.colour: d for d in discs}
        if isinstance(spec, Attribution):
            for blob in (spec.first, spec.second):
                low, high = (16, 22) if blob.size == "big" else (9, 12)
                assert low <= by_colour[blob.colour].diameter <= high, spec
        if isinstance(spec, Position):
            d = discs[0]
            along = {"left": d.x, "right": 64 - d.x, "top": d.y, "bottom": 64 - d.y}[spec.side]
            assert along <= 0.35 * 64, spec  # centre 0.15 of the side past the middle
        if isinstance(spec, Relation):
            first, second = by_colour[spec.first], by_colour[spec.second]
            dx, dy = first.x - second.x, first.y - second.y
            along, across = {
                "left of": (-dx, dy),
                "right of": (dx, dy),
                "above": (-dy, dx),
                "below": (dy, dx),
            }[spec.direction]
            assert along > 0 and abs(across) <= math.tan(math.radians(25)) * along + 1e-9, spec


def test_a_seed_is_one_image_and_seeds_vary_the_layout() -> None:
    spec = Relation("red", "left of", "blue")
    first = render(spec, np.random.default_rng(7))
    assert np.array_equal(first, render(spec, np.random.default_rng(7)))
    layouts = {layout(spec, np.random.default_rng(seed)) for seed in range(20)}
    assert len(layouts) == 20
    assert first.dtype == np.uint8 and first.shape == (64, 64, 3)
    assert render(spec, np.random.default_rng(7), size=128).shape == (128, 128, 3)


def test_paint_draws_solid_discs_with_a_one_pixel_rim_on_the_background() -> None:
    image = paint((Disc("red", 20.0, 30.0, 12.0), Disc("blue", 45.0, 40.0, 16.0)), 64)
    assert tuple(image[29, 19]) == PALETTE["red"] and tuple(image[39, 44]) == PALETTE["blue"]
    assert tuple(image[0, 0]) == BACKGROUND and tuple(image[30, 32]) == BACKGROUND
    red = np.array(PALETTE["red"], float) - np.array(BACKGROUND, float)
    left = image[:, :32].astype(float) - np.array(BACKGROUND, float)
    coverage = (left @ red / (red @ red)).sum()  # the red disc's painted area, rim included
    assert coverage == pytest.approx(math.pi * 6**2, rel=0.01)


def test_every_spec_has_a_layout_at_64_px_for_many_seeds() -> None:
    crowded = [Counting(c, 4) for c in COLOURS] + [Attribution(Blob("red", "big"), Blob("blue", "small"))]
    for spec in crowded:
        for seed in range(50):
            layout(spec, np.random.default_rng(seed))
    with pytest.raises(ValueError, match="image size 16 is outside"):
        layout(Single("red"), np.random.default_rng(0), size=16)


def test_unmentioned_blobs_fail_only_nothing_else_and_keep_the_prompts_own_layout() -> None:
    """compose-images --unmentioned S: the share S of images hold one more blob, of a colour the
    prompt does not name; the prompt's own blobs are drawn as at share 0 (the extra blob has its
    own random stream), and the verifier passes every check but "nothing else" on them."""
    from flowgrpo.compose.images import rendered_pairs
    from flowgrpo.compose.verify import analyse, verify

    prompts = [prompt_of(spec) for spec in all_specs()][::7]
    plain = list(rendered_pairs(prompts, 4))
    every = list(rendered_pairs(prompts, 4, unmentioned=1.0))
    half = list(rendered_pairs(prompts, 4, unmentioned=0.5))
    extra = 0
    for a, b, c in zip(plain, every, half, strict=True):
        spec = parse(a.text)
        assert verify(spec, a.image).correct
        named = {blob.colour for blob in blobs_of(spec)}
        found = [obj.colour for obj in analyse(b.image).blobs]
        if len(found) == len(blobs_of(spec)):  # no place left for it (a crowded count): unchanged
            assert np.array_equal(a.image, b.image)
            continue
        extra += 1
        assert len(found) == len(blobs_of(spec)) + 1 and len(set(found) - named) == 1
        failed = [check.kind for check in verify(spec, b.image).checks if not check.met]
        assert failed == ["nothing_else"], (a.text, failed)
        # where both images hold the prompt's blobs alone, they are the same image
        assert np.array_equal(c.image, a.image) or np.array_equal(c.image, b.image)
    assert extra >= 0.9 * len(plain)
    share = np.mean([not np.array_equal(a.image, c.image) for a, c in zip(plain, half, strict=True)])
    assert 0.35 <= share <= 0.6, share  # binomial: n = 204, sd 0.035 around 0.5 (less the crowded)
    with pytest.raises(ValueError, match=r"unmentioned=1\.5"):
        next(rendered_pairs(prompts, 1, unmentioned=1.5))
