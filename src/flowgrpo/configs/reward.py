"""The reward service's config (torch-free):
``flowgrpo serve reward reward.scorers=[{name: jpeg_compressibility}]``."""

from __future__ import annotations

from dataclasses import dataclass, field

from flowgrpo.fields import knob
from flowgrpo.rewards.config import RewardConfig
from flowgrpo.runtime.config import ServiceProcessConfig


@dataclass
class StreamConfig:
    """How a Score stream is cut into batches: whatever is waiting when the scorers are free,
    at most ``max_batch_samples``; ``max_wait_s`` > 0 waits that long for a batch to fill."""

    max_batch_samples: int = knob(32, 1, 65_536)
    max_wait_s: float = knob(0.0, 0.0, 3600.0)
    # requests read from a stream before scoring catches up (back-pressure)
    read_ahead: int = knob(256, 1, 1_000_000)

    def validate(self) -> None:
        if self.max_batch_samples < 1 or self.read_ahead < 1:
            raise ValueError("stream.max_batch_samples and stream.read_ahead must be >= 1")
        if self.max_wait_s < 0:
            raise ValueError(f"stream.max_wait_s={self.max_wait_s} must be >= 0")


@dataclass
class RewardServiceConfig(ServiceProcessConfig):
    reward: RewardConfig = field(default_factory=RewardConfig)
    stream: StreamConfig = field(default_factory=StreamConfig)
