"""The train / test split by combination: the committed prompt files are the command's output,
no test combination appears in training, every part of one does, every category is in both."""

from __future__ import annotations

import itertools
import subprocess
import sys
from collections import Counter
from pathlib import Path

from flowgrpo.compose.grammar import (
    CATEGORIES,
    COLOURS,
    COUNTS,
    SIDES,
    Attribution,
    Counting,
    Position,
    Relation,
    Single,
    Spec,
    TwoObjects,
    all_specs,
    parse,
)
from flowgrpo.compose.split import split

EXAMPLE = Path(__file__).resolve().parents[2] / "examples" / "data" / "compose"
# held-out pairs, written out: each colour with the one three places on (red, yellow, green,
# cyan, blue, purple, white)
TEST_PAIRS = {
    frozenset(p)
    for p in [("red", "cyan"), ("yellow", "blue"), ("green", "purple"), ("cyan", "white"),
              ("blue", "red"), ("purple", "yellow"), ("white", "green")]
}  # fmt: skip
# per category: (train, test): test = the held-out combinations counted by hand, train the rest
EXPECTED = {
    "single": (5, 2),  # green, purple held out
    "two_object": (28, 14),  # 7 pairs x 2 orders
    "counting": (21, 7),  # one count per colour
    "position": (21, 7),  # one side per colour
    "relation": (112, 56),  # 7 pairs x 2 orders x 4 directions
    "attribution": (56, 28),  # 7 pairs x 2 orders x 2 size orders
}


def _read(name: str) -> list[Spec]:
    return [parse(line) for line in (EXAMPLE / f"{name}.txt").read_text().splitlines()]


def _pair(spec: Spec) -> frozenset[str] | None:
    if isinstance(spec, TwoObjects | Relation):
        return frozenset((spec.first, spec.second))
    if isinstance(spec, Attribution):
        return frozenset((spec.first.colour, spec.second.colour))
    return None


def test_the_committed_files_are_what_the_command_writes(tmp_path: Path) -> None:
    cmd = [sys.executable, "-m", "flowgrpo.services.cli", "data", "compose-prompts", str(tmp_path / "out")]
    out = subprocess.run(cmd, capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    assert "train: 243 prompts (single 5, two_object 28," in out.stdout
    for name in ("train", "test"):
        assert (tmp_path / "out" / f"{name}.txt").read_bytes() == (EXAMPLE / f"{name}.txt").read_bytes(), (
            f"examples/data/compose/{name}.txt is stale: flowgrpo data compose-prompts examples/data/compose"
        )


def test_the_files_hold_the_split_with_every_category_in_both() -> None:
    train, test = _read("train"), _read("test")
    assert (tuple(train), tuple(test)) == (split()["train"], split()["test"])
    assert sorted(map(str, train + test)) == sorted(map(str, all_specs()))  # each prompt once
    sizes = {c: (0, 0) for c in CATEGORIES}
    for category in CATEGORIES:
        sizes[category] = (
            sum(s.category == category for s in train),
            sum(s.category == category for s in test),
        )
    assert sizes == EXPECTED


def test_no_test_combination_appears_in_training() -> None:
    train, test = _read("train"), _read("test")
    train_pairs = {p for s in train if (p := _pair(s)) is not None}
    test_pairs = {p for s in test if (p := _pair(s)) is not None}
    assert test_pairs == TEST_PAIRS and not train_pairs & TEST_PAIRS
    assert len(train_pairs) == 21 - 7  # every other pair of colours is trained on
    assert all(_pair(s) in TEST_PAIRS for s in test if _pair(s) is not None)

    def combos(specs: list[Spec], kind: type) -> set[tuple[object, ...]]:
        return {tuple(vars(s).values()) for s in specs if isinstance(s, kind)}

    for kind in (Single, Counting, Position):
        assert not combos(train, kind) & combos(test, kind), kind


def test_every_part_of_a_test_combination_is_trained_on() -> None:
    train = _read("train")
    trained_counts = Counter((s.colour, s.count) for s in train if isinstance(s, Counting))
    assert {c for c, _ in trained_counts} == set(COLOURS) and {n for _, n in trained_counts} == set(COUNTS)
    sides = {(s.colour, s.side) for s in train if isinstance(s, Position)}
    assert {c for c, _ in sides} == set(COLOURS) and {s for _, s in sides} == set(SIDES)
    paired = {c for s in train if (p := _pair(s)) is not None for c in p}
    assert paired == set(COLOURS)
    # a held-out attribution's colours are each trained big and small, with other partners
    for a, b in itertools.permutations(COLOURS, 2):
        if frozenset((a, b)) in TEST_PAIRS:
            for colour, size in itertools.product((a, b), ("big", "small")):
                assert any(
                    isinstance(s, Attribution)
                    and any(x.colour == colour and x.size == size for x in (s.first, s.second))
                    for s in train
                ), (colour, size)
