"""Rendered (prompt, image) pairs of the compose task: the supervised data that teaches the tiny
drawing model to draw (``flowgrpo data compose-images``, then ``flowgrpo sft``).

Layout ``k`` of prompt ``i`` is drawn from ``np.random.default_rng((seed, i, k))``: the same
arguments write the same images, and adding layouts keeps the earlier ones."""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from pathlib import Path

import numpy as np

from flowgrpo.compose.grammar import parse
from flowgrpo.compose.render import render
from flowgrpo.image_folder import ImageText, write_image_folder

MAX_LAYOUTS = 10_000


def rendered_pairs(
    prompts: Sequence[str], layouts: int, seed: int = 0, size: int = 64
) -> Iterator[ImageText]:
    """``layouts`` rendered images of every prompt, prompt by prompt. A prompt outside the
    grammar raises PromptError naming it (before any image of it is drawn)."""
    if not 1 <= layouts <= MAX_LAYOUTS:
        raise ValueError(f"layouts={layouts} must be in 1..{MAX_LAYOUTS}")
    specs = [parse(prompt) for prompt in prompts]  # every prompt checked first
    for i, (prompt, spec) in enumerate(zip(prompts, specs, strict=True)):
        for k in range(layouts):
            yield ImageText(prompt, render(spec, np.random.default_rng((seed, i, k)), size))


def write_rendered_folder(
    folder: str | Path, prompts: Sequence[str], layouts: int, seed: int = 0, size: int = 64
) -> int:
    """The pairs of :func:`rendered_pairs` as an image folder (atomically); returns the count."""
    return write_image_folder(folder, rendered_pairs(prompts, layouts, seed, size))
