"""A resume checks before it writes: the config a run folder was started with
(``<run_dir>/config.yaml``) against the one given now, before any service starts or any file of
the folder is written.

- A change that the saved state cannot follow (:data:`FIXED`: the model, the policy, the
  algorithm, the data and its order, the sampler geometry, the seed, ...) is refused in one line
  naming each such key, its saved and its new value and why; the folder is left as it was.
- A change it can follow (steps, cadences, logging, placement, timeouts, learning rate, ...) is
  printed, applied, and recorded: ``config.yaml`` then holds the new config, and
  ``resumes.jsonl`` one line per resume with the step and every change.
- A run whose saved step has reached ``schedule.steps`` is finished: said at once, nothing
  started (``flowgrpo train`` exits 0).
- Nothing saved yet (no ``run_state.json``): the run starts over from step 0, so every change
  applies.

Keys the saved file does not hold (written by an older version) are not compared. Torch-free.
"""

from __future__ import annotations

import json
import math
import time
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import yaml

from flowgrpo.config import ConfigError, redacted, to_dict
from flowgrpo.configs.run import RunConfig, upgraded_run_config, with_checkpoint
from flowgrpo.fileio import atomic_write
from flowgrpo.services.coordinator.outputs import STATE_FILE
from flowgrpo.yamlfile import YamlError, brief, read_yaml_file

CONFIG_FILE = "config.yaml"
RESUMES_FILE = "resumes.jsonl"

# key or section prefix -> why the saved state cannot follow a change of it
FIXED = {
    "model.": "the base model the run's checkpoints build on",
    "rollout.checkpoint": "the base model the run's checkpoints build on",
    "trainer.checkpoint": "the base model the run's checkpoints build on",
    "trainer.checkpoint_dir": "where the run's checkpoints are",
    "trainer.policy.": "the checkpoints hold this policy's tensors",
    "trainer.algorithm.name": "the checkpoints and metrics are this algorithm's",
    "trainer.loss.mode": "the objective the run trains",
    "trainer.dtype": "the precision the checkpoints are trained in",
    "data.dataset": "the prompts and their order",
    "data.prompts": "the prompts and their order",
    "data.kind": "the prompts and their order",
    "data.prompts_per_step": "the dataset cursor moves by it",
    "data.group_size": "the samples of every step and their advantages",
    "data.val_prompts": "validation compares the same prompts across the run",
    "data.val_samples": "validation compares the same images across the run",
    "sampling.": "the sampler geometry the policy is trained under",
    "schedule.seed": "noise, windows and the prompt order are functions of it",
    "schedule.mode": "the schedule the samples are drawn under",
}
PATH_KEYS = frozenset({"run_dir", "model.checkpoint", "rollout.checkpoint", "trainer.checkpoint",
                       "trainer.checkpoint_dir", "data.dataset", "data.prompts"})  # fmt: skip


class ResumeRefused(ConfigError):
    """The run folder holds a run that this config cannot resume; nothing was written."""


@dataclass(frozen=True)
class Change:
    key: str
    saved: Any
    new: Any
    why_fixed: str  # "" when the run can follow the change

    def line(self) -> str:
        return f"{self.key} {brief(self.saved)} -> {brief(self.new)}"


@dataclass(frozen=True)
class ResumePlan:
    """What the run folder holds, compared with the config given now."""

    run_dir: str
    saved_step: int  # 0: nothing saved, the run starts over
    changes: tuple[Change, ...]

    @property
    def refused(self) -> tuple[Change, ...]:
        return tuple(c for c in self.changes if c.why_fixed) if self.saved_step else ()

    def finished(self, steps: int) -> bool:
        return self.saved_step > 0 and self.saved_step >= steps

    def finished_line(self, steps: int) -> str:
        return (
            f"{self.run_dir}: the run is finished: step {self.saved_step} of schedule.steps={steps} "
            "trained; nothing to do (raise schedule.steps to train on)"
        )

    def refusal(self) -> str:
        """The one line that refuses the resume."""
        named = "; ".join(f"{c.line()} ({c.why_fixed})" for c in self.refused)
        return (
            f"cannot resume {self.run_dir} at step {self.saved_step} with this config: {named}. Keep "
            f"the saved values ({Path(self.run_dir) / CONFIG_FILE}) or give another run_dir"
        )

    def report(self) -> list[str]:
        """The lines that say what the resume changes."""
        if not self.changes:
            return []
        where = f"resuming at step {self.saved_step}" if self.saved_step else "starting over (nothing saved)"
        head = f"{self.run_dir}: {where}; changed since it was last started (recorded in {RESUMES_FILE}):"
        return [head, *(f"  {c.line()}" for c in self.changes)]


def tiny_model_folder(cfg: RunConfig) -> Path:
    """Where a run without ``model.checkpoint`` keeps the tiny random BAGEL it makes."""
    return Path(cfg.run_dir).resolve() / "model"


def prepared_data_folder(cfg: RunConfig) -> Path:
    """Where a run given ``data.prompts`` keeps them prepared."""
    return Path(cfg.run_dir).resolve() / "data"


def as_recorded(cfg: RunConfig) -> RunConfig:
    """``cfg`` as the run records it in config.yaml: the model and the dataset resolved to the
    folders :func:`~flowgrpo.services.coordinator.train.prepare_model` and ``prepare_data`` fill
    (nothing is made here)."""
    cfg = with_checkpoint(cfg, cfg.model.checkpoint or str(tiny_model_folder(cfg)))
    if not cfg.data.dataset:
        cfg = replace(cfg, data=replace(cfg.data, dataset=str(prepared_data_folder(cfg)), prompts=""))
    return cfg


def plan_resume(cfg: RunConfig) -> ResumePlan | None:
    """Compare ``cfg`` with the folder's saved config; ``None`` when the folder holds no run.
    Reads only. Raises :class:`ResumeRefused` when a saved file cannot be read."""
    folder = Path(cfg.run_dir)
    saved_path = folder / CONFIG_FILE
    if not saved_path.is_file():
        return None
    try:
        saved = read_yaml_file(saved_path, what="run config")
    except (YamlError, OSError) as error:
        raise ResumeRefused(f"cannot read the run's saved config: {error}") from None
    if not isinstance(saved, dict):
        raise ResumeRefused(f"{saved_path} holds no config (a {type(saved).__name__}): give another run_dir")
    new = _plain(yaml.safe_load(yaml.safe_dump(to_dict(redacted(as_recorded(cfg))))))
    old = _moved(_flat(_plain(upgraded_run_config(saved))), folder)
    changes = tuple(
        Change(key, value, new_value, _why_fixed(key))
        for key, value, new_value in _differences(old, _flat(new))
    )
    return ResumePlan(str(folder), _saved_step(folder), changes)


def record_resume(plan: ResumePlan) -> None:
    """Append the resume and its changes to ``resumes.jsonl`` (config.yaml is written anew by
    the run itself)."""
    if not plan.changes:
        return
    path = Path(plan.run_dir) / RESUMES_FILE
    entry = {"time": time.time(), "step": plan.saved_step,
             "changes": [{"key": c.key, "from": c.saved, "to": c.new} for c in plan.changes]}  # fmt: skip
    previous = path.read_text() if path.is_file() else ""
    atomic_write(path, previous + json.dumps(entry, default=str) + "\n")


def _saved_step(folder: Path) -> int:
    path = folder / STATE_FILE
    if not path.is_file():
        return 0
    try:
        return int(json.loads(path.read_text())["step"])
    except (OSError, ValueError, KeyError, TypeError) as error:
        raise ResumeRefused(f"{path} cannot be read ({brief(error)}): is the run folder damaged?") from None


def _moved(saved: dict[str, Any], folder: Path) -> dict[str, Any]:
    """The saved paths inside the saved ``run_dir`` as they are now, in ``folder``: a run folder
    moved (or copied) elsewhere holds its model, data and checkpoints there."""
    was = saved.get("run_dir")
    if not isinstance(was, str) or not was:
        return saved
    was_path, now = Path(was).resolve(), folder.resolve()
    out = dict(saved)
    for key in PATH_KEYS:
        value = saved.get(key)
        if isinstance(value, str) and value and Path(value).resolve().is_relative_to(was_path):
            out[key] = str(now / Path(value).resolve().relative_to(was_path))
    out["run_dir"] = str(now)
    return out


def _why_fixed(key: str) -> str:
    for prefix, why in FIXED.items():
        if key == prefix or (prefix.endswith(".") and key.startswith(prefix)):
            return why
    return ""


def _differences(saved: dict[str, Any], new: dict[str, Any]) -> list[tuple[str, Any, Any]]:
    """(key, saved, new) for every key both hold with different values, in the new config's order."""
    return [
        (key, saved[key], value)
        for key, value in new.items()
        if key in saved and not _same(key, saved[key], value)
    ]


def _same(key: str, saved: Any, new: Any) -> bool:
    if saved == new:
        return True
    if key in PATH_KEYS and isinstance(saved, str) and isinstance(new, str) and saved and new:
        return Path(saved).resolve() == Path(new).resolve()
    return False


def _flat(data: dict[str, Any], prefix: str = "") -> dict[str, Any]:
    """``{"a": {"b": 1}}`` -> ``{"a.b": 1}``; lists are values."""
    out: dict[str, Any] = {}
    for key, value in data.items():
        if isinstance(value, dict):
            out.update(_flat(value, f"{prefix}{key}."))
        else:
            out[f"{prefix}{key}"] = value
    return out


def _plain(value: Any) -> Any:
    """NaN as a string, so that equal configs compare equal (NaN != NaN)."""
    if isinstance(value, float) and math.isnan(value):
        return "nan"
    if isinstance(value, dict):
        return {str(k): _plain(v) for k, v in value.items()}
    if isinstance(value, list):
        return [_plain(v) for v in value]
    return value
