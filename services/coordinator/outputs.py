"""What a run leaves in its folder, and the run state that makes it resumable.

``<run_dir>/``: ``config.yaml`` (the resolved config), ``metrics.jsonl`` (one JSON object per
training step, and one per validation), ``run_state.json`` (written atomically after each
checkpoint: step, dataset cursor, policy version, the trainer checkpoint it matches),
``checkpoints/`` (the trainer's), ``tensorboard/`` (event files: every metric, image grids),
``images/`` (a PNG grid of sampled images per step and per validation), ``traces/`` (spans, when
no OTLP collector is set), ``logs/``.
"""

from __future__ import annotations

import io
import json
import math
import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any, TextIO

import numpy as np
import numpy.typing as npt
from PIL import Image
from tensorboard.compat.proto import event_pb2, summary_pb2
from tensorboard.summary.writer.event_file_writer import EventFileWriter

from flowgrpo.config import dump_yaml
from flowgrpo.fileio import atomic_write

STATE_FILE = "run_state.json"
METRICS_FILE = "metrics.jsonl"


@dataclass
class RunState:
    step: int = 0  # training steps completed
    cursor: int = 0  # prompts of the training order consumed
    policy_version: int = 0
    trainer_checkpoint: str = ""  # the trainer checkpoint saved with this state


class RunOutputs:
    def __init__(self, run_dir: str | Path, progress: TextIO | None = sys.stderr) -> None:
        self.dir = Path(run_dir)
        self.dir.mkdir(parents=True, exist_ok=True)
        self.progress = progress
        self._metrics = open(self.dir / METRICS_FILE, "a", encoding="utf-8")  # noqa: SIM115 (run-long)
        self._events = EventFileWriter(str(self.dir / "tensorboard"), flush_secs=10)

    def write_config(self, config: Any) -> None:
        dump_yaml(config, self.dir / "config.yaml")

    def log(self, kind: str, step: int, metrics: dict[str, float]) -> None:
        """Append one line to metrics.jsonl (flushed: a crash loses at most the line being written)."""
        record = {"kind": kind, "step": step, "time": time.time(), **_finite(metrics)}
        self._metrics.write(json.dumps(record, sort_keys=True) + "\n")
        self._metrics.flush()
        values = [
            summary_pb2.Summary.Value(tag=k, simple_value=v) for k, v in metrics.items() if math.isfinite(v)
        ]
        self._event(step, values)

    def images(self, tag: str, step: int, images: list[npt.NDArray[np.uint8]]) -> None:
        """A grid of ``images`` (H x W x 3) as ``images/<tag>_<step>.png`` and in TensorBoard."""
        if not images:
            return
        grid = image_grid(images)
        buffer = io.BytesIO()
        Image.fromarray(grid).save(buffer, format="PNG")
        png = buffer.getvalue()
        atomic_write(self.dir / "images" / f"{tag}_{step:06d}.png", png)
        picture = summary_pb2.Summary.Image(height=grid.shape[0], width=grid.shape[1], colorspace=3,
                                            encoded_image_string=png)  # fmt: skip
        self._event(step, [summary_pb2.Summary.Value(tag=f"images/{tag}", image=picture)])

    def _event(self, step: int, values: list[summary_pb2.Summary.Value]) -> None:
        event = event_pb2.Event(wall_time=time.time(), step=step, summary=summary_pb2.Summary(value=values))
        self._events.add_event(event)

    def say(self, line: str) -> None:
        if self.progress is not None:
            print(line, file=self.progress, flush=True)

    def save_state(self, state: RunState) -> None:
        atomic_write(self.dir / STATE_FILE, json.dumps(asdict(state), indent=2) + "\n")

    def load_state(self) -> RunState | None:
        path = self.dir / STATE_FILE
        if not path.is_file():
            return None
        return RunState(**json.loads(path.read_text()))

    def close(self) -> None:
        self._metrics.close()
        self._events.close()


def read_metrics(run_dir: str | Path, kind: str = "train") -> list[dict[str, Any]]:
    """The records of ``kind`` in a run's metrics.jsonl, in order (a resumed run's repeated steps:
    the last record of each step wins)."""
    by_step: dict[int, dict[str, Any]] = {}
    path = Path(run_dir) / METRICS_FILE
    for line in path.read_text().splitlines() if path.is_file() else []:
        record = json.loads(line)
        if record.get("kind") == kind:
            by_step[int(record["step"])] = record
    return [by_step[s] for s in sorted(by_step)]


def image_grid(images: list[npt.NDArray[np.uint8]], columns: int = 4) -> npt.NDArray[np.uint8]:
    """Images of one size side by side, ``columns`` per row, padded with black."""
    h, w, c = images[0].shape
    rows = -(-len(images) // columns)
    grid = np.zeros((rows * h, min(columns, len(images)) * w, c), dtype=np.uint8)
    for i, image in enumerate(images):
        r, col = divmod(i, columns)
        grid[r * h : (r + 1) * h, col * w : (col + 1) * w] = image
    return grid


def _finite(metrics: dict[str, float]) -> dict[str, float | None]:
    return {k: (float(v) if math.isfinite(float(v)) else None) for k, v in metrics.items()}
