"""The verifier: find the blobs in an image and check a prompt's constraints against them.

Detection (:func:`analyse`, :func:`detect`) reads each pixel as the background plus ``alpha``
times one palette colour: the colour is the one whose direction from the background is closest
to the pixel's (within ``COS_MIN``), ``alpha`` how far along it the pixel lies. A blob blurred
into the background, or faded towards it (a latent drawn too small), keeps its direction and loses
``alpha``, so its skirt still counts as the blob. Pixels of one colour with ``alpha`` of at
least ``ALPHA_EDGE`` are grouped into connected components (``scipy.ndimage.label``); a
component is a blob when its peak reaches ``ALPHA_PEAK`` and its size is that of a blob. A
blob's size is its *mass* (the sum of ``alpha`` over the component, in pixels): blur spreads a
blob but keeps its mass, so a blob seen through the 8 x 8 latent cells of the 64 px model
measures about what was drawn. Its centre is the alpha-weighted centroid.

:func:`verify` checks every constraint of the prompt (:class:`Check`: what was asked, met or
not, and what was found) and returns a :class:`Verdict`: ``correct`` (GenEval's all-or-nothing)
and ``score``, the share of constraints met. The checks, per category:

- each named blob is present (a counting prompt: exactly ``count`` blobs of its colour);
- ``size``: the big blob's area is at least ``SIZE_RATIO`` times the small one's;
- ``position``: the blob's centre lies in that half, ``POSITION_MARGIN`` past the middle;
- ``relation``: GenEval's rule on the two blobs' centres and sizes;
- ``nothing_else``: no blob beyond the prompt's (no other colour, no second blob of a named
  colour), no region too large to be a blob, and at most ``MAX_CLUTTER`` of the image that is
  neither background nor a blob. GenEval has no such check (an image with a red and a blue
  object passes "a photo of a red object"); here a policy could otherwise paint every colour
  everywhere and pass any "a <colour> blob", so the scene must be the prompt's.

"The blob of a colour", for size, position and relation, is the largest blob of that colour.
Lengths are fractions of the image side (written as pixels of a 64 px image), so any size from
``MIN_SIDE`` to ``MAX_SIDE`` is read alike.
"""

from __future__ import annotations

import math
from collections import Counter
from dataclasses import dataclass
from typing import Literal

import numpy as np
import numpy.typing as npt
from scipy import ndimage

from flowgrpo.compose.grammar import (
    COLOURS,
    Attribution,
    Colour,
    Counting,
    Direction,
    Position,
    Relation,
    Spec,
    blobs_of,
    check_spec,
)
from flowgrpo.compose.palette import BACKGROUND, PALETTE

PX = 1 / 64  # one pixel of a 64 px image, as a fraction of the side
# A pixel is of a colour when its direction from the background lies within 25 degrees of the
# colour's: the closest two colours are 54 degrees apart, so no pixel is near two of them, and
# blur between a blob and the background keeps the direction exactly.
COS_MIN = math.cos(math.radians(25))
# A blob's pixels: from 10% of its colour. Seen through 8 px cells (the 64 px model's latent
# grid) the smallest blob drawn (9 px) becomes a wide, faint bump peaking at 0.25 at worst; its
# skirt must be counted for its mass to be right, and it must survive colours washed out by 40%
# (measured: faded). Two blobs of one colour are drawn 16 px apart, and their skirts stay apart.
ALPHA_EDGE = 0.10
# ... and a component is a blob only where it reaches 15% of the colour somewhere: that 9 px
# blob through 8 px cells, washed out by 40% (0.25 * 0.6).
ALPHA_PEAK = 0.15
# The smallest blob, by mass as the diameter of a full disc of that area: the smallest drawn is
# 9 px and keeps >= 7.6 px through the codec; a component of noise is a few pixels (5 px: 20 px^2).
MIN_DIAMETER = 5 * PX
MAX_DIAMETER = 32 * PX  # above: a region of colour, not a blob (the largest drawn is 22 px)
# "a big red blob and a small blue blob": the red blob's area is at least 1.33 times the blue
# one's. Relative, because blur and fading shrink what is measured of both blobs alike (an
# absolute split put faded big blobs among the small); drawn, the ratio is at least
# (16 / 12)^2 = 1.78, and 1.33 is its geometric middle with 1 (equal sizes).
SIZE_RATIO = 1.33
POSITION_MARGIN = 0.05  # "on the left": centre left of 0.5 - 0.05 of the width (drawn: 0.5 - 0.15)
# GenEval's relation rule (evaluate_images.py, relative_position): shrink the centre offset by
# 0.1 of the two objects' summed sizes, then "left of" when the remaining x part is below -0.5
# of the offset's length (the offset points within 60 degrees of the left).
RELATION_SHRINK = 0.1
RELATION_SHARE = 0.5
# Clutter: a pixel this far (RGB distance) from the background, in no blob: something is there.
# 50 is a third of the dimmest colour's distance (yellow, cyan: 156); Gaussian pixel noise of
# sigma 12 stays below it (at 40, a 3.3 sigma distance, it filled 3% of the image).
CLUTTER_DISTANCE = 50.0
MAX_CLUTTER = 0.03  # of the image; a rendered image has none, one through the codec < 0.4%
MIN_SIDE, MAX_SIDE = 16, 1024  # pixels; larger images are refused, not read slowly

_DIRECTIONS = np.array([PALETTE[c] for c in COLOURS], np.float64) - np.array(BACKGROUND, np.float64)
_LENGTHS = np.linalg.norm(_DIRECTIONS, axis=1)

CheckKind = Literal["present", "count", "size", "position", "relation", "nothing_else"]


@dataclass(frozen=True)
class Object:
    """One blob (or a region too large to be one) found in an image; lengths in pixels."""

    colour: Colour
    centroid: tuple[float, float]  # (x right, y down), alpha-weighted
    area: float  # mass: the sum of alpha over its pixels
    bbox: tuple[int, int, int, int]  # x0, y0, x1, y1 of its pixels, ends exclusive

    @property
    def diameter(self) -> float:
        """The diameter of a full disc of this area."""
        return 2 * math.sqrt(self.area / math.pi)


@dataclass(frozen=True)
class Scene:
    width: int
    height: int
    blobs: tuple[Object, ...]  # largest first
    regions: tuple[Object, ...]  # components too large to be blobs
    clutter: float  # share of the image neither background nor in a blob or region

    @property
    def side(self) -> float:
        """The length that fractions of "the side" refer to: sqrt(width * height)."""
        return math.sqrt(self.width * self.height)

    def of(self, colour: Colour) -> list[Object]:
        return [b for b in self.blobs if b.colour == colour]


@dataclass(frozen=True)
class Check:
    kind: CheckKind
    asked: str  # the constraint, in words
    met: bool
    found: str  # what was found, in words: why it is met or not


@dataclass(frozen=True)
class Verdict:
    spec: Spec
    checks: tuple[Check, ...]

    @property
    def correct(self) -> bool:
        """GenEval's all-or-nothing: every constraint met."""
        return all(c.met for c in self.checks)

    @property
    def score(self) -> float:
        """Partial credit: the share of constraints met."""
        return sum(c.met for c in self.checks) / len(self.checks)

    def reasons(self) -> str:
        """One line: each constraint, met or not, and what was found."""
        return "; ".join(f"{'ok' if c.met else 'FAIL'} {c.asked}: {c.found}" for c in self.checks)


def verify(spec: Spec, image: npt.NDArray[np.uint8]) -> Verdict:
    return judge(check_spec(spec), analyse(image))


def detect(image: npt.NDArray[np.uint8]) -> list[Object]:
    """The blobs of ``image`` (uint8 [H, W, 3]), largest first."""
    return list(analyse(image).blobs)


# --- detection -------------------------------------------------------------------------------------


def analyse(image: npt.NDArray[np.uint8]) -> Scene:
    """Blobs, oversized regions and clutter of a uint8 [H, W, 3] image."""
    _check_image(image)
    height, width = image.shape[:2]
    offset = image.astype(np.float64) - np.array(BACKGROUND, np.float64)
    distance = np.linalg.norm(offset, axis=2)
    dots = offset @ _DIRECTIONS.T  # [H, W, K]
    cosine = dots / np.maximum(distance[..., None] * _LENGTHS, 1e-9)
    best = cosine.argmax(axis=2)
    alpha = np.take_along_axis(dots, best[..., None], axis=2)[..., 0] / _LENGTHS[best] ** 2
    member = (np.take_along_axis(cosine, best[..., None], axis=2)[..., 0] >= COS_MIN) & (alpha >= ALPHA_EDGE)
    side = math.sqrt(width * height)
    smallest, largest = _disc_area(MIN_DIAMETER * side), _disc_area(MAX_DIAMETER * side)
    blobs: list[Object] = []
    regions: list[Object] = []
    covered = np.zeros((height, width), bool)
    for k, colour in enumerate(COLOURS):
        found, pixels = _components(member & (best == k), alpha, colour, smallest)
        blobs += [f for f in found if f.area <= largest]
        regions += [f for f in found if f.area > largest]
        covered |= pixels
    clutter = float(np.count_nonzero((distance >= CLUTTER_DISTANCE) & ~covered)) / (width * height)
    by_size = sorted(blobs, key=lambda b: -b.area)
    return Scene(width, height, tuple(by_size), tuple(regions), clutter)


def _disc_area(diameter: float) -> float:
    return math.pi * diameter**2 / 4


def _components(
    mask: npt.NDArray[np.bool_], alpha: npt.NDArray[np.float64], colour: Colour, smallest: float
) -> tuple[list[Object], npt.NDArray[np.bool_]]:
    """The 4-connected components of ``mask`` that peak at ALPHA_PEAK or more and weigh at least
    ``smallest``, and the pixels they cover. Vectorised over components: noise has thousands."""
    if not mask.any():
        return [], mask
    labels, count = ndimage.label(mask)
    numbers = np.arange(1, count + 1)
    weight = np.where(mask, np.minimum(alpha, 1.0), 0.0)  # beyond the palette colour: fully covered
    peaks = np.asarray(ndimage.maximum(alpha, labels, numbers))
    masses = np.asarray(ndimage.sum_labels(weight, labels, numbers))
    kept = numbers[(peaks >= ALPHA_PEAK) & (masses >= smallest)]
    if not len(kept):
        return [], np.zeros_like(mask)
    ys, xs = np.indices(mask.shape, dtype=np.float64) + 0.5
    mass = masses[kept - 1]
    cx = np.asarray(ndimage.sum_labels(weight * xs, labels, kept)) / mass
    cy = np.asarray(ndimage.sum_labels(weight * ys, labels, kept)) / mass
    boxes = ndimage.find_objects(labels)
    found = []
    for i, number in enumerate(kept):
        rows, cols = boxes[number - 1]
        bbox = (int(cols.start), int(rows.start), int(cols.stop), int(rows.stop))
        found.append(Object(colour, (float(cx[i]), float(cy[i])), float(mass[i]), bbox))
    return found, np.isin(labels, kept)


def _check_image(image: object) -> None:
    if not isinstance(image, np.ndarray) or image.dtype != np.uint8 or image.ndim != 3 or image.shape[2] != 3:
        raise ValueError("the verifier reads uint8 [H, W, 3] RGB images")
    height, width = image.shape[:2]
    if not (MIN_SIDE <= height <= MAX_SIDE and MIN_SIDE <= width <= MAX_SIDE):
        raise ValueError(
            f"image of {height} x {width} pixels: the verifier reads sides of {MIN_SIDE} to {MAX_SIDE} pixels"
        )


# --- the checks ------------------------------------------------------------------------------------


def judge(spec: Spec, scene: Scene) -> Verdict:
    """Every constraint of ``spec`` checked against ``scene``."""
    checks: list[Check] = []
    if isinstance(spec, Counting):
        checks.append(_count(spec, scene))
    else:
        checks += [_present(blob.colour, scene) for blob in blobs_of(spec)]
    if isinstance(spec, Attribution):
        checks.append(_size(spec, scene))
    if isinstance(spec, Position):
        checks.append(_position(spec, scene))
    if isinstance(spec, Relation):
        checks.append(_relation(spec, scene))
    checks.append(_nothing_else(spec, scene))
    return Verdict(spec, tuple(checks))


def _present(colour: Colour, scene: Scene) -> Check:
    asked = f"a {colour} blob"
    blobs = scene.of(colour)
    if blobs:
        return Check("present", asked, True, f"found {_describe(blobs[0], scene)}")
    return Check("present", asked, False, f"no {colour} blob ({_inventory(scene)})")


def _count(spec: Counting, scene: Scene) -> Check:
    found = len(scene.of(spec.colour))
    asked = f"exactly {spec.count} {spec.colour} blob{'s' if spec.count > 1 else ''}"
    return Check("count", asked, found == spec.count, f"found {found}")


def _size(spec: Attribution, scene: Scene) -> Check:
    big, small = (spec.first, spec.second) if spec.first.size == "big" else (spec.second, spec.first)
    asked = f"the {big.colour} blob is the big one, the {small.colour} blob the small one"
    bigs, smalls = scene.of(big.colour), scene.of(small.colour)
    if not bigs or not smalls:
        missing = " and ".join(b.colour for b, found in ((big, bigs), (small, smalls)) if not found)
        return Check("size", asked, False, f"no {missing} blob")
    ratio = bigs[0].area / smalls[0].area
    across = ", ".join(f"{b.colour} {b.diameter * 64 / scene.side:.1f} px" for b in (bigs[0], smalls[0]))
    found = f"{across} across (of 64): areas {ratio:.2f} : 1, need {SIZE_RATIO:.2f}"
    return Check("size", asked, ratio >= SIZE_RATIO, found)


def _position(spec: Position, scene: Scene) -> Check:
    asked = f"the {spec.colour} blob is {_SIDE_WORDS[spec.side]}"
    blobs = scene.of(spec.colour)
    if not blobs:
        return Check("position", asked, False, f"no {spec.colour} blob")
    x, y = blobs[0].centroid
    along, extent = (x, scene.width) if spec.side in ("left", "right") else (y, scene.height)
    share = along / extent
    met = share < 0.5 - POSITION_MARGIN if spec.side in ("left", "top") else share > 0.5 + POSITION_MARGIN
    axis = "x" if spec.side in ("left", "right") else "y"
    return Check("position", asked, met, f"its centre is at {axis} = {share:.2f} of the image")


_SIDE_WORDS = {"left": "on the left", "right": "on the right", "top": "at the top", "bottom": "at the bottom"}


def relations(a: Object, b: Object) -> set[Direction]:
    """Where ``a`` lies from ``b`` by GenEval's rule, on centroids and sizes (y grows downwards)."""
    offset = np.array(a.centroid) - np.array(b.centroid)
    length = float(np.linalg.norm(offset))
    shrunk = np.maximum(np.abs(offset) - RELATION_SHRINK * (a.diameter + b.diameter), 0) * np.sign(offset)
    if length == 0 or np.all(np.abs(shrunk) < 1e-3):
        return set()
    dx, dy = shrunk / length
    found: set[Direction] = set()
    if dx < -RELATION_SHARE:
        found.add("left of")
    if dx > RELATION_SHARE:
        found.add("right of")
    if dy < -RELATION_SHARE:
        found.add("above")
    if dy > RELATION_SHARE:
        found.add("below")
    return found


def _relation(spec: Relation, scene: Scene) -> Check:
    asked = f"the {spec.first} blob is {spec.direction} the {spec.second} blob"
    first, second = scene.of(spec.first), scene.of(spec.second)
    if not first or not second:
        missing = " and ".join(c for c, found in ((spec.first, first), (spec.second, second)) if not found)
        return Check("relation", asked, False, f"no {missing} blob")
    found = relations(first[0], second[0])
    words = " and ".join(sorted(found)) if found else "in no clear direction from"
    return Check("relation", asked, spec.direction in found, f"it is {words} it")


def _nothing_else(spec: Spec, scene: Scene) -> Check:
    named = Counter(b.colour for b in blobs_of(spec))
    counted = {spec.colour} if isinstance(spec, Counting) else set()  # the count check owns these
    found = Counter(b.colour for b in scene.blobs)
    extra = {c: n - named[c] for c, n in found.items() if n > named[c] and c not in counted}
    problems = [f"{n} {c} blob{'s' if n > 1 else ''} too many" for c, n in extra.items()]
    problems += [f"a {r.colour} region of {r.area / (scene.width * scene.height):.0%}" for r in scene.regions]
    if scene.clutter > MAX_CLUTTER:
        problems.append(f"{scene.clutter:.0%} of the image is neither background nor a blob")
    return Check(
        "nothing_else", "nothing but the prompt's blobs", not problems, "; ".join(problems) or "nothing else"
    )


def _describe(blob: Object, scene: Scene) -> str:
    x, y = blob.centroid
    across = blob.diameter * 64 / scene.side
    return f"{blob.colour}, {across:.1f} px across, at ({x / scene.width:.2f}, {y / scene.height:.2f})"


def _inventory(scene: Scene) -> str:
    if not scene.blobs:
        return "no blob at all"
    counts = Counter(b.colour for b in scene.blobs)
    return "found " + ", ".join(f"{n} {c}" for c, n in counts.items())
