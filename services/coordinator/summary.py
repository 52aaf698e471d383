"""The end of ``flowgrpo train``: where the run's outputs are and the next commands, with the run's
own paths, read from its folder (so it says what is there, whatever the run did):

    run folder /abs/runs/tiny-demo (2 of 2 steps trained)
      checkpoint   /abs/runs/tiny-demo/checkpoints/step_00000002 (step 2)
      metrics      /abs/runs/tiny-demo/metrics.jsonl (2 steps, 2 validations)
      report       flowgrpo report /abs/runs/tiny-demo
      images       flowgrpo generate --run /abs/runs/tiny-demo --prompt 'a red fox' --out /abs/.../generated
      TensorBoard  tensorboard --logdir /abs/runs/tiny-demo/tensorboard

and, when a signal stopped the run, ``resume`` with the command that resumes it.
"""

from __future__ import annotations

import json
import shlex
from pathlib import Path

from flowgrpo.services.coordinator.outputs import STATE_FILE, TENSORBOARD_DIR, RunState, read_metrics

IMAGES_DIR = "images"
GENERATED_DIR = "generated"  # where the summary's generate command writes
FALLBACK_PROMPT = "a photo of a cat"  # when the run drew no image grid to take a prompt from


def end_summary(run_dir: str | Path, steps: int, resume: str = "") -> list[str]:
    """The summary's lines for the run in ``run_dir`` of ``steps`` steps; ``resume``: the command
    that resumes it (a signal stopped it), "" when it ended."""
    folder = Path(run_dir).resolve()
    quoted = shlex.quote(str(folder))
    state = read_state(folder)
    trained = len(read_metrics(folder))
    lines = [f"run folder {folder} ({state.step if state else 0} of {steps} steps trained)"]
    if state is not None and state.trainer_checkpoint:
        lines.append(f"  checkpoint   {state.trainer_checkpoint} (step {state.step})")
    else:
        lines.append("  checkpoint   none yet (schedule.save_every sets when the first is saved)")
    validations = len(read_metrics(folder, kind="val"))
    counts = f"{_many(trained, 'step')}, {_many(validations, 'validation')}"
    lines.append(f"  metrics      {folder / 'metrics.jsonl'} ({counts})")
    if trained or validations:
        lines.append(f"  report       flowgrpo report {quoted}")
    if state is not None and state.trainer_checkpoint:
        prompt = shlex.quote(a_prompt(folder))
        out = shlex.quote(str(folder / GENERATED_DIR))
        lines.append(f"  images       flowgrpo generate --run {quoted} --prompt {prompt} --out {out}")
    lines.append(f"  TensorBoard  tensorboard --logdir {shlex.quote(str(folder / TENSORBOARD_DIR))}")
    if resume:
        lines.append(f"  resume       {resume}")
    return lines


def read_state(folder: Path) -> RunState | None:
    """The run state saved with the last checkpoint, or None (nothing saved, or unreadable)."""
    try:
        return RunState(**json.loads((folder / STATE_FILE).read_text(encoding="utf-8")))
    except (OSError, ValueError, TypeError):
        return None


def a_prompt(folder: Path) -> str:
    """A prompt of the run: the first cell of its last validation grid (else of its last training
    grid), so the generate command draws what the run was validated on."""
    for kind in ("val", "train"):
        grids = sorted((folder / IMAGES_DIR).glob(f"{kind}_*.json"))
        for grid in reversed(grids):
            try:
                cells = json.loads(grid.read_text(encoding="utf-8"))["cells"]
            except (OSError, ValueError, KeyError, TypeError):
                continue
            if cells and isinstance(cells[0].get("prompt"), str) and cells[0]["prompt"].strip():
                return str(cells[0]["prompt"])
    return FALLBACK_PROMPT


def _many(count: int, thing: str) -> str:
    return f"{count} {thing}{'' if count == 1 else 's'}"
