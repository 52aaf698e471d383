"""What every scorer shares: the sample it scores, the per-sample outcome, the Scorer interface.

A scorer turns a batch of samples into one outcome per sample, in order: a :class:`SampleScore`
(the scalar, plus optional extras logged as ``critic/<scorer>/<extra>/mean``) or a
:class:`SampleError` that says what went wrong for that sample. A failed sample is never turned
into a silent 0: the caller decides what a missing reward means (the coordinator drops or
re-produces the sample).
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Literal

import numpy as np
import numpy.typing as npt

# How a sample failed; the reward service maps each onto the flowgrpo.v1.ErrorCode of the same name.
ErrorKind = Literal["invalid_argument", "unavailable", "deadline_exceeded", "unauthenticated", "internal"]


@dataclass(frozen=True)
class Sample:
    """One image to score with what the scorers may need about it.

    ``image`` is uint8 [H, W, 3] RGB (checked by :func:`flowgrpo.rewards.images.check_image`);
    ``ground_truth`` is the caption (PickScore) or the target text (OCR).
    """

    image: npt.NDArray[Any]
    prompt: str = ""
    ground_truth: str = ""
    metadata: Mapping[str, str] = field(default_factory=dict)


@dataclass(frozen=True)
class SampleScore:
    value: float
    extras: Mapping[str, float] = field(default_factory=dict)  # name -> value, for logging only


@dataclass(frozen=True)
class SampleError:
    kind: ErrorKind
    message: str  # what was wrong and, where it helps, what to do


Outcome = SampleScore | SampleError


class Scorer(ABC):
    """Scores a batch of samples. ``score`` returns exactly one outcome per sample, in order,
    and reports a sample's failure as its :class:`SampleError` rather than raising; an
    exception means the whole batch failed (the caller reports it for every sample)."""

    name: str

    @abstractmethod
    def score(self, samples: Sequence[Sample]) -> list[Outcome]: ...

    def close(self) -> None:  # noqa: B027 (a hook: most scorers hold nothing to release)
        """Release what the scorer holds (threads, connections, device memory)."""


def images_of(samples: Sequence[Sample]) -> list[npt.NDArray[np.uint8]]:
    return [s.image for s in samples]
