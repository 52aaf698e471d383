"""Rendered (prompt, image) pairs of the compose task: the supervised data that teaches the tiny
drawing model to draw (``flowgrpo data compose-images``, then ``flowgrpo sft``).

Layout ``k`` of prompt ``i`` is drawn from ``np.random.default_rng((seed, i, k))``: the same
arguments write the same images, and adding layouts keeps the earlier ones.

``unmentioned`` is the share of images that also hold a blob their prompt does not name (one of
another colour, placed anywhere it keeps its gaps): captions that describe their image in part,
as web alt-text does. Whether layout ``k`` gets one, and where, is drawn from its own stream
``(seed, i, k, 1)``, so the prompt's own blobs are the same at every share, and share 0 writes
the images it always wrote. A model pretrained on such pairs draws unasked-for objects now and
then, one of the ways real text-to-image models fail GenEval (docs/compose_task.md)."""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from pathlib import Path

import numpy as np

from flowgrpo.compose.grammar import parse
from flowgrpo.compose.render import add_unmentioned, layout, paint
from flowgrpo.image_folder import ImageText, write_image_folder

MAX_LAYOUTS = 10_000


def rendered_pairs(
    prompts: Sequence[str], layouts: int, seed: int = 0, size: int = 64, *, unmentioned: float = 0.0
) -> Iterator[ImageText]:
    """``layouts`` rendered images of every prompt, prompt by prompt. A prompt outside the
    grammar raises PromptError naming it (before any image of it is drawn)."""
    if not 1 <= layouts <= MAX_LAYOUTS:
        raise ValueError(f"layouts={layouts} must be in 1..{MAX_LAYOUTS}")
    if not 0.0 <= unmentioned <= 1.0:  # also refuses nan
        raise ValueError(f"unmentioned={unmentioned} must be a share in [0, 1]")
    specs = [parse(prompt) for prompt in prompts]  # every prompt checked first
    for i, (prompt, spec) in enumerate(zip(prompts, specs, strict=True)):
        for k in range(layouts):
            discs = layout(spec, np.random.default_rng((seed, i, k)), size)
            if unmentioned > 0:
                extra_rng = np.random.default_rng((seed, i, k, 1))
                if extra_rng.random() < unmentioned:
                    discs = add_unmentioned(discs, spec, extra_rng, size)
            yield ImageText(prompt, paint(discs, size))


def write_rendered_folder(
    folder: str | Path,
    prompts: Sequence[str],
    layouts: int,
    *,
    seed: int = 0,
    size: int = 64,
    unmentioned: float = 0.0,
) -> int:
    """The pairs of :func:`rendered_pairs` as an image folder (atomically); returns the count."""
    return write_image_folder(folder, rendered_pairs(prompts, layouts, seed, size, unmentioned=unmentioned))
