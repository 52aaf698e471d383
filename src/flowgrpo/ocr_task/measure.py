"""The OCR reward's measured accuracy on the task's images, per tier (numpy + Pillow + a
transcriber).

For each target and seed, the transcriber reads:

- ``rendered``: the target's own image (:func:`flowgrpo.ocr_task.render.render`): should read
  exactly;
- ``noise``: uniform noise of the same size: should read as nothing;
- ``mismatched``: the image of another target of the same list: should score near 0 (the
  target ``shift`` places on, so never its own: the lists hold each target once).

Each figure is the share read exactly (normalised transcription == normalised target), the mean
reward under the substring rule (flow_grpo's) and under the strict one.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from time import perf_counter

import numpy as np
import numpy.typing as npt

from flowgrpo.ocr_task.render import RenderConfig, render
from flowgrpo.ocr_task.split import Target
from flowgrpo.rewards.base import SampleError
from flowgrpo.rewards.ocr import Transcriber, normalize, ocr_reward

CONDITIONS = ("rendered", "noise", "mismatched")
Image = npt.NDArray[np.uint8]


@dataclass(frozen=True)
class Cell:
    exact: float  # share read exactly
    reward: float  # mean reward, substring rule
    strict: float  # mean reward, strict rule
    n: int


def images(
    targets: Sequence[Target], seed: int, config: RenderConfig | None = None
) -> dict[str, list[Image]]:
    """``rendered`` and ``noise``: one image per target (module doc), all from ``seed``."""
    config = config or RenderConfig()
    rng = np.random.default_rng(seed)
    rendered = [render(t.text, rng, config) for t in targets]
    noise = [rng.integers(0, 256, (config.height, config.width, 3), dtype=np.uint8) for _ in targets]
    return {"rendered": rendered, "noise": noise}


def measure(
    transcriber: Transcriber, targets: Sequence[Target], seeds: int = 1, config: RenderConfig | None = None
) -> dict[str, dict[str, Cell]]:
    """tier (and "all") -> condition -> figures, over ``seeds`` seeds. ``mismatched`` pairs each
    target with the reading of the image of the target ``shift`` places on (never its own), so the
    rendered images are read once."""
    if len(targets) < 2:
        raise ValueError("measure needs at least two targets (mismatched reads another's image)")
    scores: dict[tuple[str, str], list[tuple[bool, float, float]]] = {}
    for seed in range(seeds):
        read = {name: _read(transcriber, batch) for name, batch in images(targets, seed, config).items()}
        shift = 1 + seed % (len(targets) - 1)
        read["mismatched"] = [read["rendered"][(i + shift) % len(targets)] for i in range(len(targets))]
        for condition in CONDITIONS:
            for target, text in zip(targets, read[condition], strict=True):
                figures = (
                    normalize(text) == normalize(target.text),
                    ocr_reward(target.text, text),
                    ocr_reward(target.text, text, rule="strict"),
                )
                for row in (target.tier, "all"):
                    scores.setdefault((row, condition), []).append(figures)
    table: dict[str, dict[str, Cell]] = {}
    for (row, condition), values in scores.items():
        n = len(values)
        table.setdefault(row, {})[condition] = Cell(
            sum(v[0] for v in values) / n, sum(v[1] for v in values) / n, sum(v[2] for v in values) / n, n
        )
    return table


def _read(transcriber: Transcriber, batch: Sequence[Image]) -> list[str]:
    texts = transcriber.transcribe(batch)
    for text in texts:
        if isinstance(text, SampleError):
            raise RuntimeError(f"{transcriber.name} failed: {text.message}")
    return [str(t) for t in texts]


def format_table(table: dict[str, dict[str, Cell]]) -> str:
    """A markdown table: per tier, each condition's exact share (substring / strict mean reward)."""
    lines = ["| tier | " + " | ".join(CONDITIONS) + " |", "|" + "---|" * (len(CONDITIONS) + 1)]
    for row, cells in table.items():
        shown = [f"{cells[c].exact:.2f} ({cells[c].reward:.2f} / {cells[c].strict:.2f})" for c in CONDITIONS]
        lines.append(f"| {row} (n={cells['rendered'].n}) | " + " | ".join(shown) + " |")
    return "\n".join(lines)


def time_per_image(transcriber: Transcriber, batch: Sequence[Image], rounds: int = 1) -> float:
    """Seconds per image of ``transcriber.transcribe(batch)``, the best of ``rounds``."""
    best = float("inf")
    for _ in range(rounds):
        start = perf_counter()
        transcriber.transcribe(batch)
        best = min(best, perf_counter() - start)
    return best / len(batch)
