"""The verifier's measured accuracy, per category and per kind of image (numpy + scipy).

For every prompt of the grammar and several seeds, the verifier reads:

- ``rendered``: the prompt's own image (:func:`flowgrpo.compose.render.render`): should pass;
- ``cells2``, ``cells4``, ``cells8``: that image through :func:`codec_blur` with cells of 2, 4
  and 8 pixels (8: the 64 px model's 8 x 8 latent grid): should still pass;
- ``codec``: that image through the tiny drawing model's own autoencoder, the cell codec
  (:func:`cell_codec`, its maps in numpy; a test checks them against the model's): should pass;
- ``faded``: ``codec`` faded ``FADE`` of the way to the background (a latent drawn too small);
- ``noise``: uniform noise; ``field``: a smooth random colour field (bilinear from a random
  4 x 4 grid, what an untrained model draws): should fail;
- ``mismatched``: the image of another prompt of the grammar drawn at random: passes at the
  base rate of the grammar (an image of "a red blob on the left" is also one of "a red blob").

Each figure is the share of images judged correct (GenEval's accuracy) and the mean partial
credit. The table in docs/compose_task.md is ``flowgrpo data compose-verifier --seeds 10``.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

import numpy as np
import numpy.typing as npt

from flowgrpo.compose.grammar import CATEGORIES, Spec, all_specs
from flowgrpo.compose.palette import BACKGROUND
from flowgrpo.compose.render import render
from flowgrpo.compose.verify import verify

CONDITIONS = ("rendered", "cells2", "cells4", "cells8", "codec", "faded", "noise", "field", "mismatched")
FADE = 0.3  # faded: the codec's image, then this share of the way to the background
CODEC_CELL = 8  # pixels per latent cell of the cell codec
CODEC_ROUNDS = 3  # its decoder's upsamplings: 2x nearest, then a [1, 2, 1] / 4 blur per axis
Image = npt.NDArray[np.uint8]


def codec_blur(image: Image, cell: int) -> Image:
    """What a codec of ``cell``-pixel cells keeps: each cell's mean colour (area averaging),
    upsampled back bilinearly (cell centres as the sample points, edges clamped)."""
    height, width, _ = image.shape
    if height % cell or width % cell:
        raise ValueError(f"a {height} x {width} image is not made of {cell}-pixel cells")
    cells = image.astype(np.float64).reshape(height // cell, cell, width // cell, cell, 3).mean(axis=(1, 3))
    rows = _bilinear_weights(height // cell, cell)  # [H, H / cell]
    columns = _bilinear_weights(width // cell, cell)
    blurred: npt.NDArray[np.float64] = np.einsum("yi,ijc,xj->yxc", rows, cells, columns, optimize=True)
    return np.round(blurred).clip(0, 255).astype(np.uint8)


def _bilinear_weights(cells: int, cell: int) -> npt.NDArray[np.float64]:
    """[cells * cell, cells]: each pixel's weights on the cell centres around it."""
    position = (np.arange(cells * cell) + 0.5) / cell - 0.5  # in cell units, 0 = first centre
    position = position.clip(0, cells - 1)
    low = np.floor(position).astype(int).clip(0, max(cells - 2, 0))
    frac = position - low
    weights = np.zeros((cells * cell, cells))
    weights[np.arange(cells * cell), low] = 1 - frac
    if cells > 1:
        weights[np.arange(cells * cell), low + 1] += frac
    return weights


def cell_codec(image: Image) -> Image:
    """``image`` encoded and decoded by the cell codec (``flowgrpo.models.bagel.codec``), in numpy:
    each 8 x 8 cell's mean difference from the background, upsampled by three rounds of (repeat
    2 x 2, then the [1, 2, 1] / 4 blur per axis with background beyond the edges), the
    background added back, clamped and rounded."""
    height, width, _ = image.shape
    if height % CODEC_CELL or width % CODEC_CELL:
        raise ValueError(f"a {height} x {width} image is not made of {CODEC_CELL}-pixel cells")
    background = np.array(BACKGROUND, np.float64)
    shape = (height // CODEC_CELL, CODEC_CELL, width // CODEC_CELL, CODEC_CELL, 3)
    x: npt.NDArray[np.float64] = (image.astype(np.float64) - background).reshape(shape).mean(axis=(1, 3))
    for _ in range(CODEC_ROUNDS):
        x = _blur_121(_blur_121(x.repeat(2, axis=0).repeat(2, axis=1), 0), 1)
    return np.round(x + background).clip(0, 255).astype(np.uint8)


def _blur_121(x: npt.NDArray[np.float64], axis: int) -> npt.NDArray[np.float64]:
    """The [1, 2, 1] / 4 blur along ``axis``, with 0 (the background) beyond the edges."""
    padded = np.pad(x, [(1, 1) if a == axis else (0, 0) for a in range(x.ndim)])
    n = x.shape[axis]
    out: npt.NDArray[np.float64] = (
        padded.take(range(n), axis)
        + 2 * padded.take(range(1, n + 1), axis)
        + padded.take(range(2, n + 2), axis)
    ) / 4
    return out


def fade(image: Image, share: float) -> Image:
    """``share`` of the way from each pixel to the background: colours lose saturation."""
    background = np.array(BACKGROUND, np.float64)
    faded = image.astype(np.float64) * (1 - share) + background * share
    return np.round(faded).clip(0, 255).astype(np.uint8)


def noise_image(rng: np.random.Generator, size: int = 64) -> Image:
    return rng.integers(0, 256, (size, size, 3), dtype=np.uint8)


def smooth_field(rng: np.random.Generator, size: int = 64, grid: int = 4) -> Image:
    """A random colour at each point of a ``grid`` x ``grid`` lattice, interpolated bilinearly."""
    lattice = rng.uniform(0, 255, (grid, grid, 3))
    return codec_blur(
        np.repeat(np.repeat(lattice, size // grid, 0), size // grid, 1).astype(np.uint8), size // grid
    )


@dataclass(frozen=True)
class Cell:
    correct: float  # share of images judged correct
    score: float  # mean partial credit
    n: int


@dataclass(frozen=True)
class Table:
    rows: dict[str, dict[str, Cell]]  # category (and "all") -> condition -> figures
    seeds: int


def measure(seeds: int = 10, specs: Sequence[Spec] | None = None, size: int = 64) -> Table:
    """Every condition for every spec (default: the whole grammar) over ``seeds`` seeds."""
    specs = list(all_specs() if specs is None else specs)
    outcomes: dict[tuple[str, str], list[tuple[bool, float]]] = {}
    for index, spec in enumerate(specs):
        for seed in range(seeds):
            rng = np.random.default_rng([seed, index])
            for condition, image in _images(spec, specs, rng, size).items():
                verdict = verify(spec, image)
                for row in (spec.category, "all"):
                    outcomes.setdefault((row, condition), []).append((verdict.correct, verdict.score))
    rows: dict[str, dict[str, Cell]] = {}
    for (row, condition), values in outcomes.items():
        correct = sum(c for c, _ in values) / len(values)
        rows.setdefault(row, {})[condition] = Cell(
            correct, sum(s for _, s in values) / len(values), len(values)
        )
    return Table(rows, seeds)


def _images(spec: Spec, specs: Sequence[Spec], rng: np.random.Generator, size: int) -> dict[str, Image]:
    own = render(spec, rng, size)
    others = [s for s in specs if s != spec] or list(all_specs())
    other = others[int(rng.integers(len(others)))]
    makers: dict[str, Callable[[], Image]] = {
        "rendered": lambda: own,
        "cells2": lambda: codec_blur(own, 2),
        "cells4": lambda: codec_blur(own, 4),
        "cells8": lambda: codec_blur(own, 8),
        "codec": lambda: cell_codec(own),
        "faded": lambda: fade(cell_codec(own), FADE),
        "noise": lambda: noise_image(rng, size),
        "field": lambda: smooth_field(rng, size),
        "mismatched": lambda: render(other, rng, size),
    }
    return {name: make() for name, make in makers.items()}


def format_table(table: Table) -> str:
    """A markdown table: per category, each condition's accuracy (and mean partial credit)."""
    header = "| category | " + " | ".join(CONDITIONS) + " |"
    lines = [header, "|" + "---|" * (len(CONDITIONS) + 1)]
    for row in [*CATEGORIES, "all"]:
        if row not in table.rows:
            continue
        cells = table.rows[row]
        shown = [f"{cells[c].correct:.1%} ({cells[c].score:.2f})" for c in CONDITIONS]
        lines.append(f"| {row} (n={cells['rendered'].n}) | " + " | ".join(shown) + " |")
    return "\n".join(lines)
