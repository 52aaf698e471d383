"""What a run leaves in its folder, and the run state that makes it resumable.

``<run_dir>/``: ``config.yaml`` (the resolved config), ``metrics.jsonl`` (one JSON object per
training step, and one per validation), ``run_state.json`` (written atomically after each
checkpoint: step, dataset cursor, policy version, the trainer checkpoint it matches; a copy per
step under ``states/``),
``checkpoints/`` (the trainer's), ``tensorboard/`` (event files: every metric, image grids, the
config as text, the main settings as hparams with the final validation metrics),
``images/`` (a PNG grid of sampled images per step and per validation), ``traces/``
(every process's spans in OTLP/JSON), ``logs/``, ``run.lock`` (who runs in the folder);
``resumes.jsonl`` (each resume that changed the config: its step and the changes, ``resume.py``);
``sessions.jsonl`` and ``recipe.yaml`` (each process's command and times, the recipe without its
overrides: ``runmeta.py``);
``wandb/`` with ``logger.wandb=true``.

Progress goes to the terminal as a bar with the key metrics (``logger.progress=auto`` on a
terminal) or as one line per step (in a log file, or ``logger.progress=lines``); a long step's
notes (``progress.py``) are lines too, or the bar's description.
"""

from __future__ import annotations

import io
import json
import math
import sys
import time
import uuid
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any, TextIO, TypeVar

import numpy as np
import numpy.typing as npt
from PIL import Image
from tensorboard.compat.proto import event_pb2, summary_pb2
from tensorboard.plugins.hparams import api_pb2, metadata, plugin_data_pb2
from tensorboard.plugins.hparams import summary_v2 as hparams_summary
from tensorboard.plugins.text.summary_v2 import text_pb
from tensorboard.summary.writer.event_file_writer import EventFileWriter

from flowgrpo.config import dump_yaml, redacted, to_dict
from flowgrpo.configs.run import LoggerConfig
from flowgrpo.fileio import atomic_write

STATE_FILE = "run_state.json"
STATES_DIR = "states"  # the run state saved at each checkpoint, by step
GRID_COLUMNS = 4
GRID_CELL_PX = 256  # smaller images are enlarged (nearest neighbour) towards this: 64 px is a stamp
METRICS_FILE = "metrics.jsonl"
TENSORBOARD_DIR = "tensorboard"
# the run's main settings (dotted config keys), TensorBoard's hparams: the HPARAMS tab shows them
# beside the metrics the coordinator names (the final validation); what a run's settings differ by
HPARAMS = (
    "model.checkpoint", "data.dataset", "data.prompts_per_step", "data.group_size",
    "sampling.resolution", "sampling.num_points", "sampling.noise_level", "sampling.cfg_text_scale",
    "sampling.window_size", "sampling.branch", "sampling.deterministic", "advantages.global_std",
    "schedule.mode", "schedule.staleness", "schedule.steps", "schedule.seed", "rollout.engine",
    "trainer.algorithm.name", "trainer.loss.mode", "trainer.policy.kind", "trainer.optim.lr",
    "trainer.loss.clip_eps", "trainer.loss.kl_beta", "trainer.loss.mini_batches", "trainer.loss.logp_old",
    "trainer.dtype",
)  # fmt: skip
LORA_HPARAMS = ("trainer.policy.lora_rank", "trainer.policy.lora_alpha")  # with trainer.policy.kind=lora
# hparams has no "stopped" status: an interrupted run's session stays RUNNING (it resumes)
SESSION_STATUS = {"success": api_pb2.STATUS_SUCCESS, "interrupted": api_pb2.STATUS_RUNNING,
                  "failed": api_pb2.STATUS_FAILURE}  # fmt: skip


@dataclass
class RunState:
    step: int = 0  # training steps completed
    cursor: int = 0  # prompts of the training order consumed
    policy_version: int = 0
    trainer_checkpoint: str = ""  # the trainer checkpoint saved with this state


class RunOutputs:
    def __init__(
        self, run_dir: str | Path, progress: TextIO | None = sys.stderr, logger: LoggerConfig | None = None
    ) -> None:
        self.dir = Path(run_dir)
        self.dir.mkdir(parents=True, exist_ok=True)
        self.logger = logger or LoggerConfig()
        self.progress = None if self.logger.progress == "none" else progress
        self._metrics = open(self.dir / METRICS_FILE, "a", encoding="utf-8")  # noqa: SIM115 (run-long)
        self._events = EventFileWriter(str(self.dir / TENSORBOARD_DIR), flush_secs=10)
        self._bar: Any = None  # a tqdm bar, once the run knows its length
        self._wandb: WandbSink | None = None
        self._last_step = 0  # the highest step written to TensorBoard

    def write_config(self, config: Any, name: str = "run", metrics: Sequence[str] = ()) -> None:
        """``config.yaml``, and in TensorBoard the same text (the TEXT tab) and the main settings
        as hparams (the HPARAMS tab) with ``metrics``, the tags it shows beside them (their last
        values: the final validation's)."""
        dump_yaml(config, self.dir / "config.yaml")  # secrets emptied, as in W&B
        plain = to_dict(redacted(config))
        text = (self.dir / "config.yaml").read_text(encoding="utf-8")
        config_text = text_pb("config", "".join(f"    {line}" for line in text.splitlines(keepends=True)))
        self._event(0, list(config_text.value))  # indented: a code block in TensorBoard's markdown
        values = hparams(plain)
        experiment = hparams_summary.hparams_config_pb(
            [hparams_summary.HParam(k) for k in values], [hparams_summary.Metric(m) for m in metrics]
        )
        # one session per run folder (a resume continues it); the name would merge runs of one recipe
        session = hparams_summary.hparams_pb(values, trial_id=str(self.dir.resolve()))
        self._event(0, [*experiment.value, *session.value])
        if self.logger.wandb:
            self._wandb = WandbSink(self.dir, name, plain, self.logger)

    def end_session(self, status: str) -> None:
        """How the run's process ended (``success``, ``interrupted``, ``failed``): the hparams
        session's status in TensorBoard."""
        end = plugin_data_pb2.SessionEndInfo(status=SESSION_STATUS[status], end_time_secs=time.time())
        content = plugin_data_pb2.HParamsPluginData(session_end_info=end)
        value = summary_pb2.Summary.Value(tag=metadata.SESSION_END_INFO_TAG, tensor=metadata.NULL_TENSOR,
                                          metadata=metadata.create_summary_metadata(content))  # fmt: skip
        self._event(self._last_step, [value])

    def start_progress(self, done: int, total: int) -> None:
        """A bar from ``done`` to ``total`` steps when ``logger.progress`` asks for one (``auto``:
        when the progress stream is a terminal)."""
        stream = self.progress
        wanted = self.logger.progress == "bar" or (self.logger.progress == "auto" and _is_terminal(stream))
        if stream is not None and wanted:
            from tqdm import tqdm

            self._bar = tqdm(total=total, initial=done, file=stream, unit="step", dynamic_ncols=True)

    def step_done(self, line: str, postfix: dict[str, str]) -> None:
        """One training step: the bar moves (its postfix shows the key metrics), or a line."""
        if self._bar is None:
            self.say(line)
            return
        self._bar.set_description_str("", refresh=False)  # the step's progress note, now done
        self._bar.set_postfix(postfix, refresh=False)
        self._bar.update(1)

    def note(self, line: str) -> None:
        """Progress within a step: a line, or on a bar its description (in place, no scrolling)."""
        if self._bar is None:
            self.say(line)
        else:
            self._bar.set_description_str(line.strip())

    def log(self, kind: str, step: int, metrics: dict[str, float]) -> None:
        """Append one line to metrics.jsonl (flushed: a crash loses at most the line being written)."""
        record = {
            "kind": kind,
            "step": step,
            "time": time.time(),
            **_finite({k: float(v) for k, v in metrics.items()}),
        }
        self._metrics.write(json.dumps(record, sort_keys=True) + "\n")
        self._metrics.flush()
        values = [
            summary_pb2.Summary.Value(tag=k, simple_value=v) for k, v in metrics.items() if math.isfinite(v)
        ]
        self._event(step, values)
        if self._wandb is not None:
            self._wandb.log(kind, step, metrics)

    def images(
        self,
        tag: str,
        step: int,
        images: list[npt.NDArray[np.uint8]],
        captions: list[dict[str, Any]] | None = None,
    ) -> None:
        """A grid of ``images`` (H x W x 3) as ``images/<tag>_<step>.png`` and in TensorBoard;
        ``captions`` (each cell's prompt and reward, row by row) beside it as ``.json``."""
        if not images:
            return
        grid = image_grid(images)
        buffer = io.BytesIO()
        Image.fromarray(grid).save(buffer, format="PNG")
        png = buffer.getvalue()
        atomic_write(self.dir / "images" / f"{tag}_{step:06d}.png", png)
        if captions is not None:
            cells = {"columns": GRID_COLUMNS, "cells": [_finite(c) for c in captions]}
            atomic_write(self.dir / "images" / f"{tag}_{step:06d}.json", json.dumps(cells, indent=1) + "\n")
        picture = summary_pb2.Summary.Image(height=grid.shape[0], width=grid.shape[1], colorspace=3,
                                            encoded_image_string=png)  # fmt: skip
        self._event(step, [summary_pb2.Summary.Value(tag=f"images/{tag}", image=picture)])
        if self._wandb is not None:
            self._wandb.image(f"images/{tag}", step, grid)

    def _event(self, step: int, values: list[summary_pb2.Summary.Value]) -> None:
        self._last_step = max(self._last_step, step)
        event = event_pb2.Event(wall_time=time.time(), step=step, summary=summary_pb2.Summary(value=values))
        self._events.add_event(event)

    def say(self, line: str) -> None:
        if self._bar is not None:
            self._bar.write(line, file=self.progress)
        elif self.progress is not None:
            print(line, file=self.progress, flush=True)

    def save_state(self, state: RunState) -> None:
        """The run state, and a copy under ``states/`` by step: what a resume takes when the
        trainer had to fall back to an earlier checkpoint (the latest one was damaged)."""
        text = json.dumps(asdict(state), indent=2) + "\n"
        atomic_write(self.dir / STATES_DIR / f"step_{state.step:08d}.json", text)
        atomic_write(self.dir / STATE_FILE, text)

    def rewind(self, step: int) -> None:
        """Drop the metrics records after ``step`` (the run resumes there and logs them again),
        atomically: a crash leaves the old file or the new one, never half of one."""
        path = self.dir / METRICS_FILE
        lines = path.read_text(encoding="utf-8").splitlines(keepends=True) if path.is_file() else []
        kept = [line for line in lines if _step_of(line) <= step]
        if len(kept) == len(lines):
            return
        self._metrics.close()
        atomic_write(path, "".join(kept))
        self._metrics = open(path, "a", encoding="utf-8")  # noqa: SIM115 (run-long)

    @staticmethod
    def saved_step(run_dir: str | Path) -> int:
        """The step of the run state on disk (0 when none was saved): where a resume starts."""
        path = Path(run_dir) / STATE_FILE
        return int(json.loads(path.read_text())["step"]) if path.is_file() else 0

    def load_state(self, step: int | None = None) -> RunState | None:
        """The run state on disk (None when none was saved); with ``step``, the one saved at that
        step (None when that step's was not kept)."""
        path = self.dir / (STATE_FILE if step is None else f"{STATES_DIR}/step_{step:08d}.json")
        if not path.is_file():
            return None
        return RunState(**json.loads(path.read_text()))

    def close(self) -> None:
        if self._bar is not None:
            self._bar.close()
            self._bar = None
        self._metrics.close()
        self._events.close()
        if self._wandb is not None:
            self._wandb.finish()
            self._wandb = None


class WandbSink:
    """The run's metrics and image grids in Weights & Biases. The run id is kept in the run folder,
    so a resumed run continues the same W&B run; validation metrics are logged at their step too."""

    def __init__(self, run_dir: Path, name: str, config: dict[str, Any], logger: LoggerConfig) -> None:
        try:
            import wandb
        except ImportError:
            raise RuntimeError(
                "logger.wandb=true needs the wandb package: pip install wandb (or logger.wandb=false)"
            ) from None
        self._wandb = wandb
        id_file = run_dir / "wandb_id"
        run_id = id_file.read_text().strip() if id_file.is_file() else uuid.uuid4().hex[:12]
        atomic_write(id_file, run_id + "\n")
        self.run = wandb.init(
            project=logger.wandb_project, entity=logger.wandb_entity or None, name=name, id=run_id,
            resume="allow", dir=str(run_dir), config=config, mode=logger.wandb_mode or None,
        )  # fmt: skip

    def log(self, kind: str, step: int, metrics: dict[str, float]) -> None:
        values = {k: v for k, v in metrics.items() if math.isfinite(v) and not k.startswith("timestamp_s/")}
        self.run.log(values, step=step)

    def image(self, tag: str, step: int, grid: npt.NDArray[np.uint8]) -> None:
        self.run.log({tag: self._wandb.Image(grid)}, step=step)

    def finish(self) -> None:
        self.run.finish()


def hparams(config: dict[str, Any]) -> dict[str, bool | int | float | str]:
    """The run's main settings from its plain config (:data:`HPARAMS`, the LoRA ones with a LoRA
    policy, and the reward as ``name*weight`` terms) as TensorBoard hparams."""
    keys = list(HPARAMS)
    if _at(config, "trainer.policy.kind") == "lora":
        keys += LORA_HPARAMS
    values: dict[str, bool | int | float | str] = {}
    for key in keys:
        value = _at(config, key)
        if isinstance(value, bool | int | float | str):
            values[key] = value
    scorers = _at(config, "reward.scorers") or []
    values["reward.scorers"] = " + ".join(f"{s['name']}*{s['weight']:g}" for s in scorers)
    return values


def _at(config: dict[str, Any], key: str) -> Any:
    value: Any = config
    for part in key.split("."):
        value = value.get(part) if isinstance(value, dict) else None
    return value


def _is_terminal(stream: TextIO | None) -> bool:
    isatty = getattr(stream, "isatty", None)
    return bool(isatty and isatty())


def read_metrics(run_dir: str | Path, kind: str = "train") -> list[dict[str, Any]]:
    """The records of ``kind`` in a run's metrics.jsonl, in order (a resumed run's repeated steps:
    the last record of each step wins)."""
    by_step: dict[int, dict[str, Any]] = {}
    path = Path(run_dir) / METRICS_FILE
    for line in path.read_text().splitlines() if path.is_file() else []:
        try:
            record = json.loads(line)
        except ValueError:  # a torn last line: the run died while writing it
            continue
        if record.get("kind") == kind:
            by_step[int(record["step"])] = record
    return [by_step[s] for s in sorted(by_step)]


T = TypeVar("T")


def evenly_spaced(items: list[T], most: int) -> list[T]:
    """Up to ``most`` of ``items`` evenly spaced over the list, the first and the last included
    (which prompts a validation grid shows; which training grids a report keeps)."""
    if len(items) <= most:
        return items
    if most == 1:
        return items[:1]
    return [items[round(i * (len(items) - 1) / (most - 1))] for i in range(most)]


def image_grid(
    images: list[npt.NDArray[np.uint8]], columns: int = GRID_COLUMNS, cell_px: int = GRID_CELL_PX
) -> npt.NDArray[np.uint8]:
    """Images of one size side by side, ``columns`` per row, padded with black; each enlarged by
    the whole factor that brings its longer side closest to ``cell_px`` from below (at least 1),
    pixels repeated, not interpolated: what the policy drew, only bigger."""
    factor = max(1, cell_px // max(images[0].shape[:2]))
    if factor > 1:
        images = [image.repeat(factor, axis=0).repeat(factor, axis=1) for image in images]
    h, w, c = images[0].shape
    rows = -(-len(images) // columns)
    grid = np.zeros((rows * h, min(columns, len(images)) * w, c), dtype=np.uint8)
    for i, image in enumerate(images):
        r, col = divmod(i, columns)
        grid[r * h : (r + 1) * h, col * w : (col + 1) * w] = image
    return grid


def _step_of(line: str) -> float:
    """A metrics line's step; a torn last line (a crash mid-write) sorts after every step."""
    try:
        return float(json.loads(line)["step"])
    except (ValueError, KeyError, TypeError):
        return math.inf


def _finite(values: dict[str, Any]) -> dict[str, Any]:
    """JSON has no NaN: non-finite numbers become null (strings pass through)."""
    return {k: (None if isinstance(v, float) and not math.isfinite(v) else v) for k, v in values.items()}
