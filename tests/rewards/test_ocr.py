"""OCR target extraction and scoring: normalised Levenshtein with the substring and empty-target rules."""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import numpy.typing as npt
import pytest

from flowgrpo.rewards import Sample, SampleError, SampleScore
from flowgrpo.rewards.ocr import OcrScorer, extract_target, normalize, ocr_distance, ocr_reward


@pytest.mark.parametrize(
    ("prompt", "target"),
    [
        ('A sign that says "OPEN 24H" on a door', "OPEN 24H"),
        ('two "first" quotes "second"', "first"),
        ('an empty span "" here', ""),
        ('an unclosed "quote', None),
        ("no quotes at all", None),
    ],
)
def test_the_target_is_the_first_double_quoted_span(prompt: str, target: str | None) -> None:
    assert extract_target(prompt) == target


@pytest.mark.parametrize(
    ("target", "transcription", "reward"),
    [
        ("hello", "hello", 1.0),
        ("hello", "Say HELLO to the world", 1.0),  # substring (after lower-casing, no spaces)
        ("Hello World", "  hello\n  w o r l d\t", 1.0),  # case and whitespace do not count
        ("hello", "hallo", 0.8),  # one substitution in five characters
        ("hello", "help", 0.6),  # "hell" + o->p ... distance 2
        ("hello", "", 0.0),  # nothing read: distance capped at len(target)
        ("abc", "xyzxyzxyzxyz", 0.0),  # a longer, unrelated transcription: capped at len(target), not below 0
        ("abcd", "abxde", 0.5),  # longer transcription: the extra characters count as edits
        ("abcd", "abxd plus a lot of other text", 0.0),  # a near miss inside a long text: capped
        ("", "", 1.0),  # empty target: 1 only for an empty transcription
        ("", "anything", 0.0),
        ("  ", " \n", 1.0),  # whitespace-only target is empty
    ],
)
def test_ocr_reward_edge_cases(target: str, transcription: str, reward: float) -> None:
    assert ocr_reward(target, transcription) == pytest.approx(reward)


def test_distance_is_levenshtein_capped_at_the_target_length() -> None:
    assert normalize(" A b\tC\n") == "abc"
    assert ocr_distance("kitten", "sitting") == 3
    assert ocr_distance("abc", "abcdefgh") == 0
    assert ocr_distance("ab", "zzzzzzzz") == 2


class FakeTranscriber:
    name = "fake"

    def __init__(self, texts: list[str | SampleError]) -> None:
        self.texts = texts
        self.seen = 0

    def transcribe(self, images: Sequence[npt.NDArray[np.uint8]]) -> list[str | SampleError]:
        self.seen += len(images)
        return self.texts[: len(images)]

    def close(self) -> None:
        pass


def test_scorer_uses_the_ground_truth_else_the_prompt_and_passes_errors_through() -> None:
    image = np.zeros((8, 8, 3), np.uint8)
    failure = SampleError("unavailable", "judge down")
    transcriber = FakeTranscriber(["hello", "wrld", failure])
    samples = [
        Sample(image, prompt='a sign "ignored"', ground_truth="hello"),
        Sample(image, prompt='a sign "world"'),
        Sample(image, prompt="no target here"),
        Sample(image, prompt='a sign "third"'),
    ]
    outcomes = OcrScorer(transcriber).score(samples)
    assert outcomes[0] == SampleScore(1.0)
    assert outcomes[1] == SampleScore(0.8)
    assert isinstance(outcomes[2], SampleError) and "no OCR target" in outcomes[2].message
    assert outcomes[3] is failure
    assert transcriber.seen == 3, "a sample without target is not transcribed"


@pytest.mark.parametrize(
    ("target", "transcription", "reward"),
    [
        # 1 - Levenshtein(t, s) / max(len(t), len(s)), each distance counted by hand
        ("hello", "hello", 1.0),
        ("hello", "Say HELLO", 1 - 3 / 8),  # "sayhello": three insertions, extra text costs
        ("hello", "hallo", 1 - 1 / 5),
        ("hello", "hell", 1 - 1 / 5),  # one deletion, the target the longer
        ("kitten", "sitting", 1 - 3 / 7),  # k->s, e->i, +g
        ("ab", "abab", 1 - 2 / 4),  # the target twice: the second copy is two extra characters
        ("hello", "", 0.0),
        ("abc", "xyzxyzxyzxyz", 0.0),  # 12 edits over 12 characters
        ("", "", 1.0),
        ("", "x", 0.0),
    ],
)
def test_the_strict_rule_is_edit_distance_over_the_longer_text(
    target: str, transcription: str, reward: float
) -> None:
    assert ocr_reward(target, transcription, rule="strict") == pytest.approx(reward)


def test_the_substring_rule_stays_the_default_and_ignores_extra_text() -> None:
    assert ocr_reward("hello", "Say HELLO") == 1.0
    assert ocr_reward("hello", "Say HELLO", rule="substring") == 1.0
    with pytest.raises(ValueError, match="OCR rule 'loose'"):
        ocr_reward("a", "a", rule="loose")  # type: ignore[arg-type]


@pytest.mark.parametrize(
    ("target", "transcription", "folded", "unfolded"),
    [
        # "illinois" / "lllinois": i -> l makes both "llllnols"; unfolded one substitution in 8
        ("Illinois", "lllinois", 1.0, 1 - 1 / 8),
        ("OPEN 24", "0pen 24", 1.0, 1 - 1 / 6),  # O read as zero
        ("room 101", "rOOm lOl", 1.0, 1 - 3 / 7),  # 1 -> l, 0 -> o, 1 -> l: three substitutions in 7
        ("cold", "c0ld", 1.0, 1 - 1 / 4),
        ("cat", "cut", 1 - 1 / 3, 1 - 1 / 3),  # not look-alikes: folding changes nothing
    ],
)
def test_the_fold_maps_lookalikes_on_both_sides(
    target: str, transcription: str, folded: float, unfolded: float
) -> None:
    assert ocr_reward(target, transcription, fold=True) == pytest.approx(folded)
    assert ocr_reward(target, transcription) == pytest.approx(unfolded)
    assert ocr_reward(target, transcription, rule="strict", fold=True) == pytest.approx(folded)


def test_the_scorer_applies_its_rule_and_fold() -> None:
    image = np.zeros((8, 8, 3), np.uint8)
    samples = [Sample(image, prompt='a sign "OPEN"'), Sample(image, prompt='a sign "gold"')]
    texts: list[str | SampleError] = ["0PEN", "gold and more"]
    assert OcrScorer(FakeTranscriber(texts)).score(samples) == [SampleScore(0.75), SampleScore(1.0)]
    strict = OcrScorer(FakeTranscriber(texts), rule="strict", fold=True).score(samples)
    assert strict == [SampleScore(1.0), SampleScore(1 - 7 / 11)]  # "goldandmore": 7 extra of 11
    with pytest.raises(ValueError, match="OCR rule"):
        OcrScorer(FakeTranscriber(texts), rule="fuzzy")  # type: ignore[arg-type]
