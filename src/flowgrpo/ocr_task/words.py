"""The task's vocabulary: the words of flow_grpo's OCR prompts, shipped in ``data/words.txt``.

The list is the output of :func:`extract_words` over flow_grpo's ``dataset/ocr/test.txt``
(commit ac4c86e, MIT licence, data/SOURCE.md); it was written with::

    python -m flowgrpo.ocr_task.words path/to/flow_grpo/dataset/ocr/test.txt \\
        src/flowgrpo/ocr_task/data/words.txt

A word is a whitespace-separated token of a prompt's target (its first double-quoted span),
lower-cased, kept when it is letters a-z only (2 to MAX_LETTERS of them) or digits only (1 to
MAX_DIGITS): tokens with punctuation ("world's", "100%") or mixing the two ("t800") are left out,
so the task's alphabet is a-z and 0-9. Lower case keeps the look-alike capital I (read as l) out.
"""

from __future__ import annotations

import re
import sys
from collections.abc import Iterable
from functools import cache
from importlib import resources
from pathlib import Path

from flowgrpo.fileio import atomic_write
from flowgrpo.rewards.ocr import extract_target

MAX_LETTERS = 8  # longer words need glyphs below the readable height in a 128 px line with a neighbour
MAX_DIGITS = 6
LETTERS = re.compile(rf"[a-z]{{2,{MAX_LETTERS}}}")
DIGITS = re.compile(rf"[0-9]{{1,{MAX_DIGITS}}}")
ALPHABET = "abcdefghijklmnopqrstuvwxyz0123456789"


def extract_words(prompts: Iterable[str]) -> list[str]:
    """The distinct kept words of the prompts' targets (module doc), sorted."""
    words: set[str] = set()
    for prompt in prompts:
        target = extract_target(prompt)
        for token in (target or "").lower().split():
            if LETTERS.fullmatch(token) or DIGITS.fullmatch(token):
                words.add(token)
    return sorted(words)


@cache
def load_words() -> tuple[str, ...]:
    """The shipped list: every word, sorted (letters and digit strings alike)."""
    text = resources.files("flowgrpo.ocr_task").joinpath("data/words.txt").read_text("utf-8")
    return tuple(text.split())


def letter_words() -> tuple[str, ...]:
    return tuple(w for w in load_words() if w.isalpha())


def digit_strings() -> tuple[str, ...]:
    return tuple(w for w in load_words() if w.isdigit())


def main(argv: list[str] | None = None) -> int:
    args = sys.argv[1:] if argv is None else argv
    if len(args) != 2:
        print("usage: python -m flowgrpo.ocr_task.words PROMPTS.txt OUT.txt", file=sys.stderr)
        return 2
    source, out = Path(args[0]), Path(args[1])
    if not source.is_file():
        print(f"no prompt file at {source}", file=sys.stderr)
        return 1
    words = extract_words(source.read_text("utf-8").splitlines())
    atomic_write(out, "".join(f"{w}\n" for w in words))
    print(f"{len(words)} words from {source} -> {out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
