"""The train / test split by combination, and the prompt files it writes (pure Python).

A test prompt's combination never appears in a training prompt, while each of its parts does:

- two colours together (``two_object``, ``relation``, ``attribution``): the colour pairs
  ``(COLOURS[i], COLOURS[i + 3 mod 7])`` are test pairs, 7 of the 21, each colour in two of them.
  Every prompt naming a test pair is a test prompt, so no training image holds those two
  colours together, in any category or order;
- ``counting``: the (colour, count) pairs ``(COLOURS[i], 1 + i mod 4)``: each count for two colours;
- ``position``: the (colour, side) pairs ``(COLOURS[i], SIDES[i + 1 mod 4])``: each side for two;
- ``single``: every third colour from the third (green, purple), so the category is in both.

``flowgrpo data compose-prompts OUT_DIR`` writes ``train.txt`` and ``test.txt`` (one prompt per
line, the grammar's order), the layout ``flowgrpo data prepare compose`` reads; the files in
examples/data/compose are its output (a test checks they still are).
"""

from __future__ import annotations

from collections import Counter
from pathlib import Path

from flowgrpo.compose.grammar import (
    CATEGORIES,
    COLOURS,
    COUNTS,
    SIDES,
    Attribution,
    Colour,
    Counting,
    Position,
    Relation,
    Single,
    Spec,
    TwoObjects,
    all_specs,
    prompt_of,
)
from flowgrpo.fileio import atomic_write

PAIR_STEP = 3  # test pairs join each colour to the one 3 places on: 7 distinct pairs, 2 per colour
SPLITS = ("train", "test")


def held_out_pairs() -> frozenset[frozenset[Colour]]:
    n = len(COLOURS)
    return frozenset(frozenset((COLOURS[i], COLOURS[(i + PAIR_STEP) % n])) for i in range(n))


def colour_pair(spec: Spec) -> frozenset[Colour] | None:
    """The two colours a two-blob prompt puts together; None for the other prompts."""
    if isinstance(spec, TwoObjects | Relation):
        return frozenset((spec.first, spec.second))
    if isinstance(spec, Attribution):
        return frozenset((spec.first.colour, spec.second.colour))
    return None


def is_test(spec: Spec) -> bool:
    pair = colour_pair(spec)
    if pair is not None:
        return pair in held_out_pairs()
    if isinstance(spec, Single):
        return COLOURS.index(spec.colour) % 3 == 2
    if isinstance(spec, Counting):
        return spec.count == COUNTS[COLOURS.index(spec.colour) % len(COUNTS)]
    assert isinstance(spec, Position)
    return spec.side == SIDES[(COLOURS.index(spec.colour) + 1) % len(SIDES)]


def split() -> dict[str, tuple[Spec, ...]]:
    """Every spec of the grammar in ``train`` or ``test``, each in the grammar's order."""
    specs = all_specs()
    return {"train": tuple(s for s in specs if not is_test(s)), "test": tuple(s for s in specs if is_test(s))}


def write_prompt_files(output_dir: str | Path) -> dict[str, Path]:
    """``<output_dir>/train.txt`` and ``test.txt``, each written atomically; their paths."""
    folder = Path(output_dir)
    folder.mkdir(parents=True, exist_ok=True)
    written = {}
    for name, specs in split().items():
        written[name] = folder / f"{name}.txt"
        atomic_write(written[name], "".join(f"{prompt_of(s)}\n" for s in specs))
    return written


def summary() -> list[str]:
    """One line per split: its prompt count per category."""
    lines = []
    for name, specs in split().items():
        counts = Counter(s.category for s in specs)
        lines.append(
            f"{name}: {len(specs)} prompts (" + ", ".join(f"{c} {counts[c]}" for c in CATEGORIES) + ")"
        )
    return lines
