"""Typed configs of the scorers (torch-free): which scorers make the reward, their weights and
settings. A recipe's ``reward:`` section::

    reward:
      scorers:
        - {name: pickscore, weight: 1.0}
        - {name: ocr, weight: 0.5}
        - {name: aesthetic, weight: 0.2, plugin: my_pkg.rewards:aesthetic}
      pickscore: {model: /ckpt/PickScore_v1, processor: /ckpt/CLIP-ViT-H-14, device: "cuda:0"}
      ocr: {engine: judge, judge: {base_url: "http://vllm:8000/v1"}}
      compose: {score: partial}

or on the command line: ``reward.scorers=[{name: jpeg_compressibility, weight: 1.0}]``.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Literal

from flowgrpo.fields import knob
from flowgrpo.rewards.judge import JudgeConfig
from flowgrpo.rewards.offline_ocr import OfflineOcrConfig

# the image statistics (rewards/monitor.py) are meant with weight 0: curves to watch, not to optimise
# "synthetic": the LOAD-TEST scorer (flowgrpo bench scale): a set delay per image, a cheap score
# "compose": the compose task's verifier (docs/compose_task.md); numpy + scipy, no weights
BUILTIN_SCORERS = ("pickscore", "ocr", "jpeg_compressibility", "jpeg_incompressibility", "image_brightness",
                   "image_edge_density", "synthetic", "compose")  # fmt: skip


@dataclass
class ScorerSpec:
    """One term of the reward: ``weight * score``. ``name`` is a built-in scorer, or any name of a
    plug-in given as ``plugin`` (``path/to/file.py:function`` or ``package.module:function``)."""

    name: str = "jpeg_compressibility"
    weight: float = knob(1.0, -1e6, 1e6)
    plugin: str = ""

    def validate(self) -> None:
        if not self.name or "/" in self.name:
            raise ValueError(f"scorer name {self.name!r} must be non-empty and contain no '/'")
        if not math.isfinite(self.weight):
            raise ValueError(f"scorer {self.name}: weight {self.weight} is not finite")
        if not self.plugin and self.name not in BUILTIN_SCORERS:
            raise ValueError(
                f"scorer {self.name!r} is not built in ({', '.join(BUILTIN_SCORERS)}); "
                "a plug-in needs plugin='path/to/file.py:function' or 'package.module:function'"
            )


@dataclass
class PickScoreConfig:
    model: str = ""  # folder with config.json + model.safetensors (PickScore_v1)
    processor: str = ""  # folder with the CLIP-ViT-H-14 tokenizer + preprocessor_config.json; "" = model
    device: str = "cpu"  # "cuda", "cuda:1", "cpu"
    dtype: Literal["float32", "bfloat16", "float16"] = "float32"
    batch_size: int = knob(32, 1, 65_536)

    def validate(self) -> None:
        if self.batch_size < 1:
            raise ValueError(f"pickscore.batch_size={self.batch_size} must be >= 1")


@dataclass
class OcrConfig:
    engine: Literal["judge", "offline"] = "judge"  # judge: a VLM server (the recipes); offline: rapidocr
    judge: JudgeConfig = field(default_factory=JudgeConfig)
    offline: OfflineOcrConfig = field(default_factory=OfflineOcrConfig)
    # substring: flow_grpo's rule (text beyond the target is free); strict: edit distance against
    # the whole transcription (flowgrpo.rewards.ocr)
    rule: Literal["substring", "strict"] = "substring"
    fold: bool = False  # fold look-alikes (0/o; 1/i/l/|) in target and transcription alike

    def validate(self) -> None:
        if self.engine not in ("judge", "offline"):
            raise ValueError(f"reward.ocr.engine {self.engine!r} is not 'judge' or 'offline'")
        if self.rule not in ("substring", "strict"):
            raise ValueError(f"reward.ocr.rule {self.rule!r} is not 'substring' or 'strict'")
        self.offline.validate()


@dataclass
class ComposeConfig:
    # partial: the share of the prompt's constraints met (denser for RL); strict: GenEval's
    # all-or-nothing (1 when every constraint is met). Both log accuracy as an extra.
    score: Literal["partial", "strict"] = "partial"


@dataclass
class RewardConfig:
    scorers: list[ScorerSpec] = field(default_factory=lambda: [ScorerSpec()])
    pickscore: PickScoreConfig = field(default_factory=PickScoreConfig)
    ocr: OcrConfig = field(default_factory=OcrConfig)
    compose: ComposeConfig = field(default_factory=ComposeConfig)
    jpeg_quality: int = knob(95, 1, 100)
    # scorer "synthetic": simulated seconds of work per image
    synthetic_delay_s: float = knob(0.0, 0.0, 3600.0)

    def validate(self) -> None:
        names = [s.name for s in self.scorers]
        if not 0 <= self.synthetic_delay_s <= 60:
            raise ValueError(f"reward.synthetic_delay_s={self.synthetic_delay_s} must be in [0, 60]")
        if not names:
            raise ValueError("reward.scorers is empty: name at least one scorer")
        if len(set(names)) != len(names):
            raise ValueError(f"reward.scorers: names must be unique, got {names}")
        for spec in self.scorers:
            spec.validate()
        if "ocr" in names:
            self.ocr.validate()
        if "pickscore" in names and not self.pickscore.model:
            raise ValueError("scorer pickscore needs reward.pickscore.model (a PickScore_v1 folder)")
        if not 1 <= self.jpeg_quality <= 100:
            raise ValueError(f"reward.jpeg_quality={self.jpeg_quality} is outside 1..100")
