"""The task's vocabulary and split: held-out targets are unseen combinations, unseen words,
pseudo-words and digit strings, all made of characters the training targets use."""

from __future__ import annotations

import hashlib
from collections import Counter
from pathlib import Path

import pytest

from flowgrpo.ocr_task.split import (
    MAX_LINE,
    TEST_TIERS,
    TRAIN_TIERS,
    prompt_of,
    prompts,
    split,
    write_prompt_files,
)
from flowgrpo.ocr_task.words import ALPHABET, digit_strings, extract_words, letter_words, load_words, main
from flowgrpo.rewards.ocr import extract_target


def test_extraction_keeps_lower_case_letter_words_and_digit_strings() -> None:
    lines = [
        'A sign "Spring Collection 2024" here',
        'A mug "World\'s Best DAD" and "ignored"',
        'A board "T800 at 100% a x" in red',
        "no target at all",
        'a "Supercalifragilistic" word',  # 21 letters: too long for a line
    ]
    # "collection": 10 letters, over MAX_LETTERS; "a", "x": one letter; "t800", "100%": mixed
    assert extract_words(lines) == ["2024", "at", "best", "dad", "spring"]


def test_the_shipped_list_is_what_the_extraction_keeps(tmp_path: Path) -> None:
    words = load_words()
    assert len(words) == 1239 and list(words) == sorted(set(words))
    assert set("".join(words)) == set(ALPHABET)
    assert extract_words(f'x "{w}"' for w in words) == list(words)  # every word passes the filter
    source = tmp_path / "prompts.txt"
    source.write_text('a "Lost City" b\nc "lost 42"\n')
    assert main([str(source), str(tmp_path / "w.txt")]) == 0
    assert (tmp_path / "w.txt").read_text() == "42\ncity\nlost\n"
    assert main([str(tmp_path / "missing.txt"), str(tmp_path / "w.txt")]) == 1


def test_the_tiers_and_their_sizes() -> None:
    parts = split()
    counts = {name: Counter(t.tier for t in targets) for name, targets in parts.items()}
    held = [w for w in letter_words() if hashlib.sha256(w.encode()).digest()[0] < 32]  # 1/8 of 256
    assert counts["train"] == {"word": len(letter_words()) - len(held), "pair": 800, "number": 82}
    assert counts["test"] == {"new_pair": 100, "unseen_word": len(held), "pseudo_word": 100, "digits": 60}
    assert set(counts["train"]) == set(TRAIN_TIERS) and set(counts["test"]) == set(TEST_TIERS)
    assert split() == parts, "deterministic"


def test_held_out_targets_are_unseen_and_made_of_seen_characters() -> None:
    train, test = split()["train"], split()["test"]
    train_texts = {t.text for t in train}
    train_words = {w for t in train for w in t.text.split()}
    train_pairs = {frozenset(t.text.split()) for t in train if t.tier == "pair"}
    seen_chars = set("".join(train_texts).replace(" ", ""))
    assert seen_chars == set(ALPHABET)
    for target in test:
        assert target.text not in train_texts, target
        assert set(target.text.replace(" ", "")) <= seen_chars
        words = target.text.split()
        if target.tier == "new_pair":
            assert len(words) == 2 and set(words) <= train_words and frozenset(words) not in train_pairs
        elif target.tier == "unseen_word":
            assert words[0] in letter_words() and words[0] not in train_words
        elif target.tier == "pseudo_word":
            assert target.text.isalpha() and target.text not in load_words()
        else:
            assert target.text.isdigit() and target.text not in digit_strings()
    assert len({t.text for t in test}) == len(test)


def test_every_target_fits_a_line_and_its_prompt_gives_it_back(tmp_path: Path) -> None:
    for name, targets in split().items():
        assert all(len(t.text) <= MAX_LINE for t in targets if t.tier in ("pair", "new_pair"))
        assert [extract_target(p) for p in prompts(name)] == [t.text for t in targets]
    written = write_prompt_files(tmp_path)
    assert written["test"].read_text().splitlines() == prompts("test")
    with pytest.raises(ValueError, match="holds a double quote"):
        prompt_of('say "hi"')
    with pytest.raises(ValueError, match="use 'train' or 'test'"):
        prompts("valid")


def test_pairs_skip_excluded_and_repeated_combinations() -> None:
    import numpy as np

    from flowgrpo.ocr_task.split import _pairs

    # three words make three combinations; one excluded leaves exactly two, in either order
    pairs = _pairs(
        ("ab", "cd", "ef"), 2, np.random.default_rng(0), exclude=frozenset({frozenset(("ab", "cd"))})
    )
    assert {frozenset(p.split()) for p in pairs} == {frozenset(("ab", "ef")), frozenset(("cd", "ef"))}
    # a ten-letter word with any other makes 13 or more characters, over MAX_LINE (10): one pair fits
    long = _pairs(("abcdefghij", "klmnopqrst", "ab", "cd"), 1, np.random.default_rng(0), exclude=frozenset())
    assert long in (["ab cd"], ["cd ab"])
