"""The verifier's measured accuracy, per category and per kind of image (numpy + scipy).

For every prompt of the grammar and several seeds, the verifier reads:

- ``rendered``: the prompt's own image (:func:`flowgrpo.compose.render.render`): should pass;
- ``cells2``, ``cells4``, ``cells8``: that image through :func:`codec_blur` with cells of 2, 4
  and 8 pixels (8: the 64 px model's 8 x 8 latent grid): should still pass;
- ``faded8``: ``cells8`` faded ``FADE`` of the way to the background (washed-out colours);
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

CONDITIONS = ("rendered", "cells2", "cells4", "cells8", "faded8", "noise", "field", "mismatched")
FADE = 0.3  # faded8: cells8, then this share of the way to the background (desaturated colours)
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
        "faded8": lambda: fade(codec_blur(own, 8), FADE),
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
