"""The prompt grammar: every prompt parses to its spec and back, the categories hold the
combinations counted by hand, and anything outside the grammar is refused naming the word."""

from __future__ import annotations

import subprocess
import sys
from collections import Counter

import pytest

from flowgrpo.compose.grammar import (
    MAX_PROMPT_CHARS,
    Attribution,
    Blob,
    Counting,
    Position,
    PromptError,
    Relation,
    Single,
    TwoObjects,
    all_specs,
    blobs_of,
    check_spec,
    parse,
    prompt_of,
)

# 7 colours; ordered pairs of two different colours: 7 * 6 = 42
EXPECTED_SIZES = {
    "single": 7,
    "two_object": 42,
    "counting": 7 * 4,  # counts 1..4
    "position": 7 * 4,  # left, right, top, bottom
    "relation": 42 * 4,  # left of, right of, above, below
    "attribution": 42 * 2,  # the first blob big or small
}


def test_every_prompt_parses_to_its_spec_and_back() -> None:
    specs = all_specs()
    prompts = [prompt_of(s) for s in specs]
    assert len(set(prompts)) == len(prompts) == len(set(specs))
    for spec, prompt in zip(specs, prompts, strict=True):
        assert parse(prompt) == spec, prompt
        assert prompt_of(parse(prompt)) == prompt


def test_the_categories_hold_every_combination() -> None:
    assert Counter(s.category for s in all_specs()) == EXPECTED_SIZES
    assert max(len(prompt_of(s)) for s in all_specs()) < MAX_PROMPT_CHARS


@pytest.mark.parametrize(
    ("prompt", "spec"),
    [
        ("a red blob", Single("red")),
        ("a red blob and a blue blob", TwoObjects("red", "blue")),
        ("one white blob", Counting("white", 1)),
        ("three green blobs", Counting("green", 3)),
        ("a cyan blob at the bottom", Position("cyan", "bottom")),
        ("a red blob to the left of a blue blob", Relation("red", "left of", "blue")),
        ("a white blob below a purple blob", Relation("white", "below", "purple")),
        (
            "a small yellow blob and a big blue blob",
            Attribution(Blob("yellow", "small"), Blob("blue", "big")),
        ),
        ("  A  Red\tBLOB ", Single("red")),  # case and whitespace are free
    ],
)
def test_prompts_read_as_written(prompt: str, spec: object) -> None:
    assert parse(prompt) == spec


@pytest.mark.parametrize(
    ("prompt", "word"),
    [
        ("a red blob in the middle", "word 4, 'in'"),
        ("a red blob on the top", "word 6, 'top'"),
        ("an orange blob", "word 1, 'an'"),
        ("a orange blob", "word 2, 'orange'"),
        ("a black blob", "word 2, 'black'"),  # invisible on the dark background: not a colour here
        ("a red square", "word 3, 'square'"),
        ("three green blob", "word 3, 'blob'"),
        ("one green blobs", "word 3, 'blobs'"),
        ("five red blobs", "word 1, 'five'"),
        ("a red blob and a red blob", "word 6, 'red': the two blobs need different colours"),
        ("a red blob above a red blob", "word 6, 'red'"),
        ("a big red blob", "word 2, 'big': a size is used only"),
        ("a big red blob on the left", "word 2, 'big'"),
        ("a red blob above a small blue blob", "word 6, 'small'"),
        ("a big red blob and a blue blob", "word 7, 'blue': give both blobs a size"),
        ("a red blob and a small blue blob", "word 6, 'small': give both blobs a size"),
        ("a big red blob and a big blue blob", "word 7, 'big': one blob is big"),
        ("a red blob to the left a blue blob", "word 7, 'a'"),
        ("a red blob.", "word 3, 'blob.'"),
        ("a red blob and", "word 5, (the end)"),
        ("", "word 1, (the end)"),
    ],
)
def test_anything_else_is_refused_naming_the_prompt_and_the_word(prompt: str, word: str) -> None:
    with pytest.raises(PromptError) as error:
        parse(prompt)
    message = str(error.value)
    assert f"cannot read prompt {prompt!r}: {word}" in message, message
    assert "\n" not in message


def test_an_errors_reason_leaves_the_prompt_out() -> None:
    with pytest.raises(PromptError) as error:
        parse("a red blob in the middle")
    assert error.value.reason.startswith("word 4, 'in': expected")
    assert str(error.value) == f"cannot read prompt 'a red blob in the middle': {error.value.reason}"


def test_the_parser_reads_a_bounded_text() -> None:
    with pytest.raises(PromptError, match=f"201 characters, more than {MAX_PROMPT_CHARS}"):
        parse("a" * 201)
    with pytest.raises(PromptError, match="a prompt is a string"):
        parse(b"a red blob")  # type: ignore[arg-type]


@pytest.mark.parametrize(
    ("spec", "why"),
    [
        (Single("orange"), "unknown colour 'orange'"),  # type: ignore[arg-type]
        (Counting("red", 5), "count 5 is outside 1..4"),
        (TwoObjects("red", "red"), "two different colours"),
        (Attribution(Blob("red", "big"), Blob("blue", "big")), "one big and one small"),
        (Attribution(Blob("red"), Blob("blue")), "one big and one small"),
    ],
)
def test_specs_outside_the_grammar_have_no_prompt(spec: object, why: str) -> None:
    with pytest.raises(PromptError, match=why):
        check_spec(spec)  # type: ignore[arg-type]
    with pytest.raises(PromptError, match=why):
        prompt_of(spec)  # type: ignore[arg-type]


def test_blobs_of_lists_what_the_image_must_hold() -> None:
    assert blobs_of(Counting("green", 3)) == (Blob("green"),) * 3
    assert blobs_of(Relation("red", "above", "blue")) == (Blob("red"), Blob("blue"))
    big_red, small_blue = Blob("red", "big"), Blob("blue", "small")
    assert blobs_of(Attribution(small_blue, big_red)) == (small_blue, big_red)


def test_the_grammar_and_data_preparation_need_no_scipy() -> None:
    """The data image prepares compose prompts without the verifier's dependencies."""
    code = (
        "import sys; sys.modules['scipy'] = None; sys.modules['torch'] = None\n"
        "import flowgrpo.compose, flowgrpo.compose.split, flowgrpo.data.prepare\n"
        "assert flowgrpo.compose.parse('two red blobs').count == 2\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
