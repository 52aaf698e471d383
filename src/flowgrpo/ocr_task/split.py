"""The text-rendering task's targets, prompts and train / test split (pure Python).

Targets are lower-case words of flow_grpo's OCR prompts (:mod:`~flowgrpo.ocr_task.words`), one
or two on a line. The split holds out what a model could only get right by spelling, never by
recalling a training image; every character of a test target occurs in training (tested).

Train tiers:

- ``word``: each seen word alone (a word is held out when the first byte of its SHA-256 is
  below HOLD_OUT * 256: a fixed, order-free choice of about one word in eight);
- ``pair``: two seen words on one line, TRAIN_PAIRS pairs drawn with a fixed seed;
- ``number``: the digit strings of the prompt file.

Test tiers:

- ``new_pair``: two seen words never together in a training pair (in either order);
- ``unseen_word``: the held-out words of the file;
- ``pseudo_word``: pronounceable strings of consonant-vowel syllables, no word of the file;
- ``digits``: digit strings of 2-5 digits the file does not hold.

Prompts are in flow_grpo's style, the target between the first pair of double quotes
(``flowgrpo.rewards.ocr.extract_target`` reads it back), the template picked by the target's
place in its split. ``write_prompt_files(dir)`` writes ``train.txt`` and ``test.txt``.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass
from functools import cache
from pathlib import Path

import numpy as np

from flowgrpo.fileio import atomic_write
from flowgrpo.ocr_task.words import digit_strings, letter_words

TRAIN_TIERS = ("word", "pair", "number")
TEST_TIERS = ("new_pair", "unseen_word", "pseudo_word", "digits")
HOLD_OUT = 1 / 8  # share of the file's words held out as unseen
MAX_LINE = 10  # characters of a two-word line, the space included (11 needed 15 px in DejaVu Sans Bold)
TRAIN_PAIRS = 800
TEST_PAIRS = 100
PSEUDO_WORDS = 100
TEST_DIGITS = 60
SEED = 62  # the split's own generator (issue #62); changing it changes the split
CONSONANTS, VOWELS = "bcdfghjklmnprstvwz", "aeiou"
TEMPLATES = (
    'A shop sign that says "{}"',
    'A poster with the words "{}" in large letters',
    'A wooden board with "{}" painted on it',
    'A label that reads "{}"',
    'A neon sign glowing "{}" on a brick wall',
    'A chalkboard with "{}" written on it',
    'A banner displaying "{}"',
    'A street sign marked "{}"',
)


@dataclass(frozen=True)
class Target:
    text: str
    tier: str


def held_out(word: str) -> bool:
    return hashlib.sha256(word.encode()).digest()[0] < HOLD_OUT * 256


def seen_words() -> tuple[str, ...]:
    return tuple(w for w in letter_words() if not held_out(w))


@cache
def split() -> dict[str, tuple[Target, ...]]:
    """``train`` and ``test``, each target once, in tier order."""
    rng = np.random.default_rng(SEED)
    seen = seen_words()
    train_pairs = _pairs(seen, TRAIN_PAIRS, rng, exclude=frozenset())
    used = frozenset(frozenset(p.split()) for p in train_pairs)
    test_pairs = _pairs(seen, TEST_PAIRS, rng, exclude=used)
    vocabulary = frozenset(letter_words())
    numbers = frozenset(digit_strings())
    train = (
        [Target(w, "word") for w in seen]
        + [Target(p, "pair") for p in train_pairs]
        + [Target(n, "number") for n in digit_strings()]
    )
    test = (
        [Target(p, "new_pair") for p in test_pairs]
        + [Target(w, "unseen_word") for w in letter_words() if held_out(w)]
        + [Target(w, "pseudo_word") for w in _pseudo_words(PSEUDO_WORDS, rng, vocabulary)]
        + [Target(d, "digits") for d in _digit_strings(TEST_DIGITS, rng, numbers)]
    )
    return {"train": tuple(train), "test": tuple(test)}


def prompt_of(target: str, variant: int = 0) -> str:
    if '"' in target or not target.strip():
        raise ValueError(f"OCR target {target!r} is empty or holds a double quote")
    return TEMPLATES[variant % len(TEMPLATES)].format(target)


def prompts(name: str) -> list[str]:
    """The prompts of split ``name`` ("train" or "test"), one per target, in order."""
    if name not in ("train", "test"):
        raise ValueError(f"OCR task split {name!r}: use 'train' or 'test'")
    return [prompt_of(t.text, i) for i, t in enumerate(split()[name])]


def write_prompt_files(output_dir: str | Path) -> dict[str, Path]:
    """``<output_dir>/train.txt`` and ``test.txt``, each written atomically; their paths."""
    folder = Path(output_dir)
    folder.mkdir(parents=True, exist_ok=True)
    written = {}
    for name in ("train", "test"):
        written[name] = folder / f"{name}.txt"
        atomic_write(written[name], "".join(f"{p}\n" for p in prompts(name)))
    return written


def _pairs(
    words: tuple[str, ...], count: int, rng: np.random.Generator, exclude: frozenset[frozenset[str]]
) -> list[str]:
    """``count`` distinct lines of two different words, at most MAX_LINE characters, whose
    word set is not in ``exclude``."""
    found: dict[frozenset[str], str] = {}
    while len(found) < count:
        first, second = (words[int(i)] for i in rng.integers(len(words), size=2))
        key = frozenset((first, second))
        if first != second and len(first) + 1 + len(second) <= MAX_LINE and key not in exclude | found.keys():
            found[key] = f"{first} {second}"
    return list(found.values())


def _pseudo_words(count: int, rng: np.random.Generator, vocabulary: frozenset[str]) -> list[str]:
    """``count`` distinct strings of 2-3 consonant-vowel syllables (a closing consonant half the
    time), none a word of ``vocabulary``."""
    found: dict[str, None] = {}
    while len(found) < count:
        syllables = int(rng.integers(2, 4))
        word = "".join(CONSONANTS[rng.integers(len(CONSONANTS))] + VOWELS[rng.integers(len(VOWELS))]
                       for _ in range(syllables))  # fmt: skip
        if rng.random() < 0.5:
            word += CONSONANTS[rng.integers(len(CONSONANTS))]
        if word not in vocabulary:
            found[word] = None
    return list(found)


def _digit_strings(count: int, rng: np.random.Generator, known: frozenset[str]) -> list[str]:
    found: dict[str, None] = {}
    while len(found) < count:
        digits = "".join(str(d) for d in rng.integers(0, 10, size=int(rng.integers(2, 6))))
        if digits not in known:
            found[digits] = None
    return list(found)
