"""OCR reward: how well the text rendered in an image matches the target text of the prompt.

The target is the first double-quoted span of the prompt (``extract_target``; data preparation
uses the same function and should refuse an empty span). Both texts are lower-cased and
stripped of all whitespace; the distance is 0 when the target is a substring of the
transcription, else min(Levenshtein, len(target)); reward = 1 - distance / len(target). An
empty target scores 1 only for an empty transcription.

The transcription comes from a :class:`Transcriber`: a judge model behind an OpenAI-compatible
server (:mod:`flowgrpo.rewards.judge`) or an offline engine (:mod:`flowgrpo.rewards.offline_ocr`).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Protocol

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


def ocr_distance(target: str, transcription: str) -> int:
    """On normalised texts: 0 if the target is a substring of the transcription, else
    min(Levenshtein distance, len(target))."""
    from rapidfuzz.distance import Levenshtein  # here: importing the package must not need it

    t, s = normalize(target), normalize(transcription)
    if t in s:
        return 0
    return min(Levenshtein.distance(t, s), len(t))


def ocr_reward(target: str, transcription: str) -> float:
    """1 - distance / len(target), in [0, 1]. An empty target scores 1 for an empty
    transcription and 0 for any other (the substring rule would give it 1 everywhere)."""
    t = normalize(target)
    if not t:
        return 0.0 if normalize(transcription) else 1.0
    return 1.0 - ocr_distance(t, transcription) / len(t)


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
    puts the extracted target there), else the first quoted span of the prompt."""

    def __init__(self, transcriber: Transcriber, name: str = "ocr") -> None:
        self.name = name
        self.transcriber = transcriber

    def score(self, samples: Sequence[Sample]) -> list[Outcome]:
        outcomes: list[Outcome] = [_NO_TARGET] * len(samples)
        targets = {i: t for i, s in enumerate(samples) if (t := self.target(s)) is not None}
        texts = self.transcriber.transcribe(images_of([samples[i] for i in targets]))
        if len(texts) != len(targets):
            raise RuntimeError(
                f"{self.transcriber.name} returned {len(texts)} transcriptions for {len(targets)} images"
            )
        for (i, target), text in zip(targets.items(), texts, strict=True):
            outcomes[i] = text if isinstance(text, SampleError) else SampleScore(ocr_reward(target, text))
        return outcomes

    @staticmethod
    def target(sample: Sample) -> str | None:
        return sample.ground_truth or extract_target(sample.prompt)

    def close(self) -> None:
        self.transcriber.close()
