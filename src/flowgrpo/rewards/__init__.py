"""Scorers of generated images, usable without the reward service.

- :mod:`~flowgrpo.rewards.base`: :class:`Sample`, the :class:`Scorer` interface, per-sample outcomes;
- :mod:`~flowgrpo.rewards.images`: the accepted image format (uint8 [H, W, 3]);
- :mod:`~flowgrpo.rewards.jpeg`: JPEG (in)compressibility;
- :mod:`~flowgrpo.rewards.ocr`: OCR target extraction and scoring, the ``Transcriber`` interface;
- :mod:`~flowgrpo.rewards.judge`: transcription by a VLM behind an OpenAI-compatible server;
- :mod:`~flowgrpo.rewards.offline_ocr`: transcription by RapidOCR (weights ship in the package);
- :mod:`~flowgrpo.rewards.pickscore`: PickScore with a local CLIP (torch + transformers);
- :mod:`~flowgrpo.rewards.compose`: the compose task's verifier (numpy + scipy, no weights);
- :mod:`~flowgrpo.rewards.plugins`: user rewards ``path/to/file.py:function``;
- :mod:`~flowgrpo.rewards.combine`: the weighted sum, ``critic/<name>/mean`` metrics;
- :mod:`~flowgrpo.rewards.config` / :mod:`~flowgrpo.rewards.build`: typed configs and the builder;
- :mod:`~flowgrpo.rewards.tiny_clip`: a random CLIP in the published layout (tests, demo, bench).

This package imports neither torch, the OCR engine nor scipy; the modules that need them import them.
"""

from flowgrpo.rewards.base import Outcome, Sample, SampleError, SampleScore, Scorer
from flowgrpo.rewards.build import build_reward, build_scorer
from flowgrpo.rewards.combine import RewardModel, Scored, Weighted, reward_metrics
from flowgrpo.rewards.config import RewardConfig, ScorerSpec
from flowgrpo.rewards.images import ImageError, check_image

__all__ = [
    "ImageError",
    "Outcome",
    "RewardConfig",
    "RewardModel",
    "Sample",
    "SampleError",
    "SampleScore",
    "Scored",
    "Scorer",
    "ScorerSpec",
    "Weighted",
    "build_reward",
    "build_scorer",
    "check_image",
    "reward_metrics",
]
