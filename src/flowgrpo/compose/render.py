"""Images of the grammar's prompts: anti-aliased discs on the plain background (numpy only).

``render(spec, np.random.default_rng(seed))`` is a deterministic function of (spec, seed, size)
and draws one of many layouts of the prompt: sizes and positions are jittered, and only the
prompt's blobs are drawn (GenEval's images hold nothing beyond the prompt's objects either).
Lengths are fractions of the image side, written as pixels of the 64 px images the tiny model
makes: there an image is seen through the autoencoder's 8 x 8 grid of latent cells, so a small
blob is at least about one cell across and blobs keep gaps the blur cannot close.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np
import numpy.typing as npt

from flowgrpo.compose.grammar import (
    COLOURS,
    Attribution,
    Blob,
    Colour,
    Counting,
    Direction,
    Position,
    Relation,
    Side,
    Spec,
    blobs_of,
    check_spec,
)
from flowgrpo.compose.palette import BACKGROUND, PALETTE

PX = 1 / 64  # one pixel of a 64 px image, as a fraction of the side
SMALL_DIAMETER = (9 * PX, 12 * PX)  # "small": about one latent cell across, never less
BIG_DIAMETER = (16 * PX, 22 * PX)  # "big": two to three cells; the verifier splits them at 14 px
FREE_DIAMETER = (10 * PX, 18 * PX)  # a blob whose size the prompt leaves open
COUNT_DIAMETER = (9 * PX, 14 * PX)  # the blobs of a counting prompt: four must fit with their gaps
GAP = 6 * PX  # between the edges of two blobs of different colours
# same colour: their blurred skirts must not join, or the verifier's labelling sees one blob.
# Through the cell codec, two blobs 14 px apart still joined at its 10% edge in 41 of 288
# worst-case placements (side by side, diagonal, every offset on the cells); 16 px: none
SAME_COLOUR_GAP = 16 * PX
BORDER = 2 * PX  # between a blob's edge and the image's
SIDE_MARGIN = 0.15  # "on the left": the centre lies left of 0.5 - this (the verifier asks 0.5 - 0.05)
RELATION_SPREAD = math.radians(25)  # "left of": within this angle of the horizontal (GenEval allows 60)
MAX_TRIES = 1_000  # layouts drawn before giving up (measured worst: 36, a relation whose first blob fell off)
PLACE_TRIES = 100  # positions tried for one disc before the layout is drawn again
MIN_SIZE, MAX_SIZE = 32, 1024  # pixels a side


@dataclass(frozen=True)
class Disc:
    """One blob as drawn: its colour, centre (x right, y down) and diameter, in pixels."""

    colour: Colour
    x: float
    y: float
    diameter: float

    @property
    def radius(self) -> float:
        return self.diameter / 2


def render(spec: Spec, rng: np.random.Generator, size: int = 64) -> npt.NDArray[np.uint8]:
    """uint8 [size, size, 3]: one random layout of the prompt, painted."""
    return paint(layout(spec, rng, size), size)


def layout(spec: Spec, rng: np.random.Generator, size: int = 64) -> tuple[Disc, ...]:
    """Discs that satisfy the prompt with margins: sizes, sides, directions, gaps and borders."""
    check_spec(spec)
    if not MIN_SIZE <= size <= MAX_SIZE:
        raise ValueError(f"image size {size} is outside {MIN_SIZE}..{MAX_SIZE} pixels")
    for _ in range(MAX_TRIES):
        discs = _draw(spec, rng, size)
        if discs is not None and _separated(discs, size):
            return discs
    raise RuntimeError(f"no layout of {spec} found in {MAX_TRIES} tries at {size} px")


def add_unmentioned(
    discs: tuple[Disc, ...], spec: Spec, rng: np.random.Generator, size: int = 64
) -> tuple[Disc, ...]:
    """``discs`` and one more blob of a colour the prompt does not name, where it keeps its gaps:
    the image a caption describes in part (web alt-text names the main objects and leaves the
    rest out). Unchanged when no place is found in PLACE_TRIES draws (a crowded counting layout)."""
    named = {blob.colour for blob in blobs_of(spec)}
    others = [colour for colour in COLOURS if colour not in named]
    colour = others[int(rng.integers(len(others)))]
    diameter = _diameter(FREE_DIAMETER, rng, size)
    for _ in range(PLACE_TRIES):
        extra = _anywhere(colour, diameter, rng, size)
        if _separated((*discs, extra), size):
            return (*discs, extra)
    return discs


def paint(discs: tuple[Disc, ...], size: int) -> npt.NDArray[np.uint8]:
    """The discs over the background, in order, each edge anti-aliased over one pixel."""
    centres = np.arange(size, dtype=np.float64) + 0.5
    xs, ys = np.meshgrid(centres, centres)
    image = np.empty((size, size, 3), np.float64)
    image[:] = BACKGROUND
    for disc in discs:
        # coverage of each pixel: 1 inside, 0 outside, linear across the one-pixel rim
        cover = np.clip(disc.radius + 0.5 - np.hypot(xs - disc.x, ys - disc.y), 0.0, 1.0)[..., None]
        image = image * (1 - cover) + np.array(PALETTE[disc.colour], np.float64) * cover
    return np.round(image).clip(0, 255).astype(np.uint8)


# --- drawing one candidate layout ----------------------------------------------------------------


def _draw(spec: Spec, rng: np.random.Generator, size: int) -> tuple[Disc, ...] | None:
    """A candidate layout, or None when a disc found no place; the caller draws again."""
    if isinstance(spec, Relation):
        return _relation(spec, rng, size)
    if isinstance(spec, Position):
        return (_on_side(spec.colour, spec.side, _diameter(FREE_DIAMETER, rng, size), rng, size),)
    placed: list[Disc] = []
    for blob in blobs_of(spec):  # one at a time, each where it keeps its gaps to those placed
        diameter = _diameter(_range(spec, blob), rng, size)
        for _ in range(PLACE_TRIES):
            disc = _anywhere(blob.colour, diameter, rng, size)
            if _separated((*placed, disc), size):
                placed.append(disc)
                break
        else:
            return None
    return tuple(placed)


def _range(spec: Spec, blob: Blob) -> tuple[float, float]:
    if isinstance(spec, Attribution):
        return BIG_DIAMETER if blob.size == "big" else SMALL_DIAMETER
    return COUNT_DIAMETER if isinstance(spec, Counting) else FREE_DIAMETER


def _diameter(bounds: tuple[float, float], rng: np.random.Generator, size: int) -> float:
    return float(rng.uniform(*bounds)) * size


def _anywhere(colour: Colour, diameter: float, rng: np.random.Generator, size: int) -> Disc:
    low, high = diameter / 2 + BORDER * size, size - diameter / 2 - BORDER * size
    return Disc(colour, float(rng.uniform(low, high)), float(rng.uniform(low, high)), diameter)


def _on_side(colour: Colour, side: Side, diameter: float, rng: np.random.Generator, size: int) -> Disc:
    """A disc whose centre lies in ``side``'s half, SIDE_MARGIN away from the middle line."""
    low, high = diameter / 2 + BORDER * size, size - diameter / 2 - BORDER * size
    near = (0.5 - SIDE_MARGIN) * size  # the farthest a "left" centre may lie from the left edge
    along = float(rng.uniform(low, near))  # across the image from that side's edge inwards
    free = float(rng.uniform(low, high))
    if side == "left":
        return Disc(colour, along, free, diameter)
    if side == "right":
        return Disc(colour, size - along, free, diameter)
    if side == "top":
        return Disc(colour, free, along, diameter)
    return Disc(colour, free, size - along, diameter)


UNIT: dict[Direction, tuple[float, float]] = {
    "left of": (-1.0, 0.0), "right of": (1.0, 0.0), "above": (0.0, -1.0), "below": (0.0, 1.0)
}  # fmt: skip


def _relation(spec: Relation, rng: np.random.Generator, size: int) -> tuple[Disc, ...] | None:
    """The second blob anywhere, the first at an angle within RELATION_SPREAD of the direction."""
    second = _anywhere(spec.second, _diameter(FREE_DIAMETER, rng, size), rng, size)
    diameter = _diameter(FREE_DIAMETER, rng, size)
    nearest = (diameter + second.diameter) / 2 + GAP * size
    distance = float(rng.uniform(nearest, 0.8 * size))
    angle = math.atan2(UNIT[spec.direction][1], UNIT[spec.direction][0])
    angle += float(rng.uniform(-RELATION_SPREAD, RELATION_SPREAD))
    first = Disc(
        spec.first, second.x + distance * math.cos(angle), second.y + distance * math.sin(angle), diameter
    )
    return (first, second) if _inside(first, size) else None


def _inside(disc: Disc, size: int) -> bool:
    margin = disc.radius + BORDER * size
    return margin <= disc.x <= size - margin and margin <= disc.y <= size - margin


def _separated(discs: tuple[Disc, ...], size: int) -> bool:
    """Every pair of discs keeps its gap (a wider one between blobs of the same colour)."""
    for i, a in enumerate(discs):
        for b in discs[i + 1 :]:
            gap = (SAME_COLOUR_GAP if a.colour == b.colour else GAP) * size
            if math.hypot(a.x - b.x, a.y - b.y) < a.radius + b.radius + gap:
                return False
    return True
