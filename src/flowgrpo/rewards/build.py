"""Build the reward a :class:`~flowgrpo.rewards.config.RewardConfig` describes. Heavy scorers
(PickScore: torch + transformers; offline OCR: onnxruntime; compose: scipy) are imported only
when configured."""

from __future__ import annotations

from flowgrpo.rewards.base import Scorer
from flowgrpo.rewards.combine import RewardModel, Weighted
from flowgrpo.rewards.config import OcrConfig, PickScoreConfig, RewardConfig, ScorerSpec
from flowgrpo.rewards.jpeg import JpegScorer
from flowgrpo.rewards.monitor import MONITORS, ImageStatScorer, SyntheticScorer
from flowgrpo.rewards.ocr import OcrScorer, Transcriber
from flowgrpo.rewards.plugins import PluginScorer


def build_reward(config: RewardConfig) -> RewardModel:
    config.validate()
    parts: list[Weighted] = []
    try:
        for spec in config.scorers:
            parts.append(Weighted(build_scorer(spec, config), spec.weight))
    except BaseException:
        for part in parts:
            part.scorer.close()
        raise
    return RewardModel(parts)


def build_scorer(spec: ScorerSpec, config: RewardConfig) -> Scorer:
    if spec.plugin:
        return PluginScorer.load(spec.name, spec.plugin)
    if spec.name in ("jpeg_compressibility", "jpeg_incompressibility"):
        return JpegScorer(
            spec.name, incompressible=spec.name == "jpeg_incompressibility", quality=config.jpeg_quality
        )
    if spec.name in MONITORS:
        return ImageStatScorer(spec.name)
    if spec.name == "synthetic":
        return SyntheticScorer(config.synthetic_delay_s)
    if spec.name == "ocr":
        return OcrScorer(
            build_transcriber(config.ocr), name=spec.name, rule=config.ocr.rule, fold=config.ocr.fold
        )
    if spec.name == "pickscore":
        return _pickscore(config.pickscore)
    if spec.name == "compose":
        from flowgrpo.rewards.compose import ComposeScorer

        return ComposeScorer(config.compose.score, name=spec.name)
    raise ValueError(f"unknown scorer {spec.name!r}")  # ScorerSpec.validate names the valid ones


def build_transcriber(config: OcrConfig) -> Transcriber:
    if config.engine == "judge":
        from flowgrpo.rewards.judge import JudgeClient

        return JudgeClient(config.judge)
    from flowgrpo.rewards.offline_ocr import RapidOcrTranscriber

    return RapidOcrTranscriber(config.offline)


def _pickscore(config: PickScoreConfig) -> Scorer:
    from flowgrpo.rewards.pickscore import PickScorer

    return PickScorer.from_folders(
        config.model,
        config.processor or None,
        device=config.device,
        dtype=config.dtype,
        batch_size=config.batch_size,
    )
