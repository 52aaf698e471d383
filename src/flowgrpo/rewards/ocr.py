"""OCR reward: how well the text rendered in an image matches the target text of the prompt.

The target is the first double-quoted span of the prompt (``extract_target``; data preparation
uses the same function and should refuse an empty span). Both texts are lower-cased and
stripped of all whitespace (``normalize``), then scored by one of two rules:

- ``substring`` (the default; flow_grpo's, kept for parity): the distance is 0 when the target
  is a substring of the transcription, else min(Levenshtein, len(target)); reward = 1 -
  distance / len(target). Text beyond the target costs nothing: an image covered in words that
  include the target scores 1;
- ``strict``: reward = 1 - Levenshtein(target, transcription) / max(len(target),
  len(transcription)), the edit distance against the whole transcription, so every extra
  character is an edit; exactly 1 only when the image holds the target and nothing else.

An empty target scores 1 only for an empty transcription, under either rule.

Look-alike characters: with ``fold`` both texts are folded after normalising (``fold_lookalikes``:
``0`` -> ``o``; ``1``, ``i`` and ``|`` -> ``l``), so a sans-serif capital I read as ``l`` (both
lower-case to different letters) or an O read as a zero costs nothing. Off by default, as in
flow_grpo; the OCR task (:mod:`flowgrpo.ocr_task`) needs no fold, its targets being lower-case.

The transcription comes from a :class:`Transcriber`: a judge model behind an OpenAI-compatible
server (:mod:`flowgrpo.rewards.judge`) or an offline engine (:mod:`flowgrpo.rewards.offline_ocr`).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Literal, Protocol

import numpy as np
import numpy.typing as npt

from flowgrpo.rewards.base import Outcome, Sample, SampleError, SampleScore, Scorer, images_of


def extract_target(prompt: str) -> str | None:
    """The text between the first pair of double quotes (``"``), or None without such a pair."""
    start = prompt.find('"')
    end = prompt.find('"', start + 1) if start >= 0 else -1
    return prompt[start + 1 : end] if end >= 0 else None


def normalize(text: str) -> str:
    """Lower-cased, every whitespace character removed."""
    return "".join(text.lower().split())


OcrRule = Literal["substring", "strict"]
OCR_RULES: tuple[OcrRule, ...] = ("substring", "strict")
# sans-serif capital I, lower-case l, one and the bar; capital O and zero: each class to one letter
LOOKALIKES = str.maketrans({"0": "o", "1": "l", "i": "l", "|": "l"})


def fold_lookalikes(text: str) -> str:
    """``text`` with each look-alike class mapped to one character (module doc); apply after
    :func:`normalize` (the classes are lower-case)."""
    return text.translate(LOOKALIKES)


def ocr_distance(target: str, transcription: str) -> int:
    """On normalised texts: 0 if the target is a substring of the transcription, else
    min(Levenshtein distance, len(target))."""
    from rapidfuzz.distance import Levenshtein  # here: importing the package must not need it

    t, s = normalize(target), normalize(transcription)
    if t in s:
        return 0
    return min(Levenshtein.distance(t, s), len(t))


def ocr_reward(target: str, transcription: str, rule: OcrRule = "substring", fold: bool = False) -> float:
    """The reward in [0, 1] under ``rule`` (module doc), the texts folded first when ``fold``. An
    empty target scores 1 for an empty transcription and 0 for any other (the substring rule
    would give it 1 everywhere)."""
    if rule not in OCR_RULES:
        raise ValueError(f"OCR rule {rule!r}: use one of {', '.join(OCR_RULES)}")
    t, s = normalize(target), normalize(transcription)
    if fold:
        t, s = fold_lookalikes(t), fold_lookalikes(s)
    if not t:
        return 0.0 if s else 1.0
    if rule == "substring":
        return 1.0 - ocr_distance(t, s) / len(t)
    from rapidfuzz.distance import Levenshtein

    return 1.0 - Levenshtein.distance(t, s) / max(len(t), len(s))


class Transcriber(Protocol):
    """Reads the text in images: one string (or a per-image error) per image, in order."""

    name: str

    def transcribe(self, images: Sequence[npt.NDArray[np.uint8]]) -> list[str | SampleError]: ...

    def close(self) -> None: ...


_NO_TARGET = SampleError(
    "invalid_argument",
    "no OCR target: the ground truth is empty and the prompt has no double-quoted text; "
    "prepare OCR data with flowgrpo.rewards.ocr.extract_target",
)


class OcrScorer(Scorer):
    """OCR reward of each image against its target: ``ground_truth`` when set (data preparation
    puts the extracted target there), else the first quoted span of the prompt; ``rule`` and
    ``fold`` as in :func:`ocr_reward`."""

    def __init__(
        self, transcriber: Transcriber, name: str = "ocr", rule: OcrRule = "substring", fold: bool = False
    ) -> None:
        if rule not in OCR_RULES:
            raise ValueError(f"OCR rule {rule!r}: use one of {', '.join(OCR_RULES)}")
        self.name = name
        self.transcriber = transcriber
        self.rule, self.fold = rule, fold

    def score(self, samples: Sequence[Sample]) -> list[Outcome]:
        outcomes: list[Outcome] = [_NO_TARGET] * len(samples)
        targets = {i: t for i, s in enumerate(samples) if (t := self.target(s)) is not None}
        texts = self.transcriber.transcribe(images_of([samples[i] for i in targets]))
        if len(texts) != len(targets):
            raise RuntimeError(
                f"{self.transcriber.name} returned {len(texts)} transcriptions for {len(targets)} images"
            )
        for (i, target), text in zip(targets.items(), texts, strict=True):
            outcomes[i] = (
                text
                if isinstance(text, SampleError)
                else SampleScore(ocr_reward(target, text, self.rule, self.fold))
            )
        return outcomes

    @staticmethod
    def target(sample: Sample) -> str | None:
        return sample.ground_truth or extract_target(sample.prompt)

    def close(self) -> None:
        self.transcriber.close()
