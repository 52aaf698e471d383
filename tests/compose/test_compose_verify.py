"""The verifier: blobs found where they were painted, every prompt's own images pass (sharp and
through the codec's cells), other prompts' images, noise and colour fields fail, and each
verdict says which constraint failed."""

from __future__ import annotations

import itertools
import math

import numpy as np
import pytest

from flowgrpo.compose.grammar import (
    CATEGORIES,
    COLOURS,
    Attribution,
    Blob,
    Counting,
    Position,
    Relation,
    Single,
    Spec,
    TwoObjects,
    all_specs,
)
from flowgrpo.compose.measure import cell_codec, codec_blur, fade, noise_image, smooth_field
from flowgrpo.compose.palette import BACKGROUND, PALETTE
from flowgrpo.compose.render import Disc, paint, render
from flowgrpo.compose.verify import Object, analyse, detect, relations, verify


def _image(spec: Spec, seed: int) -> np.ndarray:
    return render(spec, np.random.default_rng(seed))


def test_blobs_are_found_where_they_were_painted() -> None:
    discs = (Disc("red", 15.0, 20.0, 12.0), Disc("cyan", 45.5, 44.0, 20.0), Disc("white", 48.0, 12.0, 9.0))
    found = {b.colour: b for b in detect(paint(discs, 64))}
    assert sorted(found) == ["cyan", "red", "white"]
    for disc in discs:
        blob = found[disc.colour]
        assert blob.centroid == pytest.approx((disc.x, disc.y), abs=0.05)
        assert blob.diameter == pytest.approx(disc.diameter, abs=0.1)  # mass: pi r^2, rim included
        x0, y0, x1, y1 = blob.bbox
        assert x0 <= disc.x - disc.radius and x1 >= disc.x + disc.radius
        assert y0 <= disc.y - disc.radius and y1 >= disc.y + disc.radius
    assert detect(np.full((64, 64, 3), BACKGROUND, np.uint8)) == []


def test_blur_keeps_a_blobs_mass_and_centre() -> None:
    image = paint((Disc("purple", 30.0, 27.0, 16.0),), 64)
    for cell in (2, 4, 8):
        [blob] = detect(codec_blur(image, cell))
        assert blob.colour == "purple"
        assert blob.centroid == pytest.approx((30.0, 27.0), abs=0.6)
        assert 14.5 <= blob.diameter <= 16.1, cell  # the faintest skirt (< ALPHA_EDGE) is not counted


@pytest.mark.parametrize("cell", [1, 8])
def test_every_prompts_own_images_pass(cell: int) -> None:
    for index, spec in enumerate(all_specs()):
        for seed in range(2):
            image = _image(spec, 1000 * seed + index)
            verdict = verify(spec, codec_blur(image, cell) if cell > 1 else image)
            assert verdict.correct and verdict.score == 1.0, (spec, verdict.reasons())


def test_images_through_the_codec_pass_washed_out_too() -> None:
    for index, spec in enumerate(all_specs()[::2]):
        through = cell_codec(_image(spec, index))
        for image in (through, fade(through, 0.3)):
            verdict = verify(spec, image)
            assert verdict.correct, (spec, verdict.reasons())


def test_noise_and_colour_fields_fail_every_category() -> None:
    rng = np.random.default_rng(0)
    specs = all_specs()[::7]
    for spec in specs:
        assert not verify(spec, noise_image(rng)).correct
        assert not verify(spec, smooth_field(rng)).correct
    assert {s.category for s in specs} == set(CATEGORIES)


# --- mismatched images: the failing check names the difference -----------------------------------


def _failed(spec: Spec, image: np.ndarray) -> list[str]:
    verdict = verify(spec, image)
    return [c.kind for c in verdict.checks if not c.met]


def test_swapped_sizes_fail_attribution_only_on_size() -> None:
    big_red_small_blue = Attribution(Blob("red", "big"), Blob("blue", "small"))
    swapped = Attribution(Blob("red", "small"), Blob("blue", "big"))
    for seed in range(10):
        image = _image(swapped, seed)
        verdict = verify(big_red_small_blue, image)
        assert [c.kind for c in verdict.checks if not c.met] == ["size"], verdict.reasons()
        assert verdict.score == 3 / 4  # present red, present blue, nothing else: met
        assert verify(swapped, image).correct


def test_opposite_relations_and_sides_fail_on_them() -> None:
    for seed in range(10):
        assert _failed(
            Relation("red", "left of", "blue"), _image(Relation("red", "right of", "blue"), seed)
        ) == ["relation"]
        assert _failed(Relation("red", "above", "blue"), _image(Relation("blue", "above", "red"), seed)) == [
            "relation"
        ]
        assert _failed(Position("green", "top"), _image(Position("green", "bottom"), seed)) == ["position"]


def test_counts_colours_and_extras() -> None:
    for seed in range(10):
        assert _failed(Counting("green", 3), _image(Counting("green", 2), seed)) == ["count"]
        assert _failed(Counting("green", 3), _image(Counting("green", 4), seed)) == ["count"]
        assert _failed(Counting("green", 3), _image(Counting("blue", 3), seed)) == ["count", "nothing_else"]
        assert _failed(Single("red"), _image(TwoObjects("red", "blue"), seed)) == ["nothing_else"]
        assert _failed(Single("red"), _image(Counting("red", 2), seed)) == ["nothing_else"]
        assert _failed(TwoObjects("red", "blue"), _image(Single("red"), seed)) == ["present"]
        assert _failed(Single("red"), _image(Single("yellow"), seed)) == ["present", "nothing_else"]


def test_a_red_blob_on_either_side_is_also_a_red_blob() -> None:
    """Why the mismatched base rate is not 0: some other prompts' images satisfy a prompt."""
    for seed, side in itertools.product(range(5), ("left", "right", "top", "bottom")):
        assert verify(Single("red"), _image(Position("red", side), seed)).correct


def test_a_verdict_lists_each_constraint_with_what_was_found() -> None:
    spec = Relation("red", "left of", "blue")
    verdict = verify(spec, paint((Disc("blue", 16.0, 32.0, 12.0), Disc("red", 48.0, 32.0, 12.0)), 64))
    assert [(c.kind, c.met) for c in verdict.checks] == [
        ("present", True),
        ("present", True),
        ("relation", False),
        ("nothing_else", True),
    ]
    assert not verdict.correct and verdict.score == 0.75
    assert "FAIL the red blob is left of the blue blob: it is right of it" in verdict.reasons()


def test_regions_and_clutter_are_not_blobs() -> None:
    wash = np.full((64, 64, 3), PALETTE["red"], np.uint8)
    scene = analyse(wash)
    assert scene.blobs == () and [r.colour for r in scene.regions] == ["red"]
    assert _failed(Single("red"), wash) == ["present", "nothing_else"]
    orange_stripe = paint((Disc("red", 20.0, 20.0, 12.0),), 64)
    orange_stripe[50:56, :] = (255, 100, 0)  # 28 degrees from yellow, 30 from red: no colour's
    assert analyse(orange_stripe).clutter == pytest.approx(6 / 64)
    assert _failed(Single("red"), orange_stripe) == ["nothing_else"]


def test_relations_follow_genevals_rule() -> None:
    def blob(x: float, y: float, diameter: float = 10.0) -> Object:
        return Object("red", (x, y), math.pi * diameter**2 / 4, (0, 0, 1, 1))

    assert relations(blob(10, 30), blob(40, 32)) == {"left of"}
    assert relations(blob(10, 10), blob(40, 40)) == {"left of", "above"}  # 45 degrees: both
    # offset (30, 20): shrunk by 0.1 * (10 + 10) to (28, 18), over its length 36.06: dy = 0.50
    assert relations(blob(40, 40), blob(10, 20)) == {"right of"}
    assert relations(blob(40, 41), blob(10, 20)) == {"right of", "below"}  # 19 / 36.6 = 0.52
    assert relations(blob(12, 12), blob(10, 10)) == set()  # within 0.1 of their sizes: no direction


def test_images_out_of_bounds_are_refused() -> None:
    with pytest.raises(ValueError, match="sides of 16 to 1024 pixels"):
        verify(Single("red"), np.zeros((2048, 64, 3), np.uint8))
    with pytest.raises(ValueError, match="uint8"):
        verify(Single("red"), np.zeros((64, 64, 3), np.float32))  # type: ignore[arg-type]


def test_the_palettes_colours_point_far_apart_from_the_background() -> None:
    grey = BACKGROUND
    vectors = {c: [PALETTE[c][i] - grey[i] for i in range(3)] for c in COLOURS}
    for a, b in itertools.combinations(COLOURS, 2):
        u, v = vectors[a], vectors[b]
        cosine = sum(x * y for x, y in zip(u, v, strict=True)) / (math.hypot(*u) * math.hypot(*v))
        assert math.degrees(math.acos(cosine)) >= 54.0, (a, b)
    assert min(math.hypot(*v) for v in vectors.values()) > 150
