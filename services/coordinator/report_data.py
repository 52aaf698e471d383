"""What ``flowgrpo report`` shows, as plain data (the page is :mod:`.report`): the runs read from
their folders, the panels (plot specs the page's script draws), the metrics that say nothing
(flat: the same value, often 0, at every step), the image grids, the run metadata and the config
against its recipe. Torch-free, plotting-library-free: a panel is a dict of lists of numbers.

A panel: ``{"title", "y", "note", "traces": [{"name", "x", "y", "smooth", "mode", "dash", "lo", "hi"}]}``
(``lo``/``hi``: a band around the line; ``None`` in ``y``: no value at that step)."""

from __future__ import annotations

import base64
import io
import json
import math
import re
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import yaml
from PIL import Image

from flowgrpo.configs.run import upgraded_run_config
from flowgrpo.services.coordinator.outputs import evenly_spaced, read_metrics
from flowgrpo.services.coordinator.runmeta import RECIPE_FILE, RunSession, read_sessions
from flowgrpo.services.coordinator.trace import busy_per_step

REWARD = "critic/rewards/mean"
NOT_METRICS = ("kind", "step", "time")
# sections first to last; any other prefix after them, alphabetically
SECTION_ORDER = ("critic", "actor", "trainer", "timing_s", "perf", "services", "validation",
                 "coordinator", "publication", "training", "timestamp_s")  # fmt: skip
MAX_TRAIN_GRIDS = 60  # evenly spaced, the first and the last always in: a page stays a few MB
Panel = dict[str, Any]


@dataclass
class Run:
    dir: Path
    label: str
    train: list[dict[str, Any]]
    val: list[dict[str, Any]]
    config: dict[str, Any]
    recipe: dict[str, Any] | None  # the recipe without the overrides (recipe.yaml), if recorded
    sessions: list[RunSession]

    @property
    def weights(self) -> dict[str, float]:
        """Each scorer of the run's reward and its weight."""
        scorers = (self.config.get("reward") or {}).get("scorers") or []
        return {
            str(s["name"]): float(s.get("weight", 1.0))
            for s in scorers
            if isinstance(s, dict) and "name" in s
        }

    @property
    def is_control(self) -> bool:
        """lr = 0: the same prompts and noise, nothing learnt (the demo's control)."""
        lr = ((self.config.get("trainer") or {}).get("optim") or {}).get("lr")
        return lr is not None and float(lr) == 0.0


def load_runs(run_dirs: Iterable[str | Path]) -> list[Run]:
    runs = [load_run(Path(d)) for d in run_dirs]
    names = [r.dir.resolve().name for r in runs]
    for run, name in zip(runs, names, strict=True):  # a folder's name, or parent/name when two share it
        run.label = name if names.count(name) == 1 else f"{run.dir.resolve().parent.name}/{name}"
    return runs


def load_run(run_dir: Path) -> Run:
    if not (run_dir / "config.yaml").is_file():
        raise FileNotFoundError(f"{run_dir} is not a run folder (no config.yaml): give the run_dir of a run")
    train = read_metrics(run_dir)
    if not train:
        raise ValueError(f"{run_dir} has no training steps in metrics.jsonl yet: nothing to report")
    _add_busy(run_dir, train)
    recipe = run_dir / RECIPE_FILE
    return Run(
        dir=run_dir,
        label=run_dir.name,
        train=train,
        val=read_metrics(run_dir, kind="val"),
        config=_saved_config(yaml.safe_load((run_dir / "config.yaml").read_text())),
        recipe=(yaml.safe_load(recipe.read_text()) or {}) if recipe.is_file() else None,
        sessions=read_sessions(run_dir),
    )


def _add_busy(run_dir: Path, train: list[dict[str, Any]]) -> None:
    """Each service's busy seconds per step, from the traces, as ``services/<name>`` metrics."""
    if not (run_dir / "traces").is_dir():
        return
    for record, busy in zip(train, busy_per_step(str(run_dir), [int(r["step"]) for r in train]), strict=True):
        record.update({f"services/{name}": seconds for name, seconds in busy.items()})


# --- the panels ----------------------------------------------------------------------------------


def values(records: list[dict[str, Any]], key: str) -> list[float | None]:
    out: list[float | None] = []
    for r in records:
        v = r.get(key)
        out.append(None if v is None or not math.isfinite(float(v)) else float(v))
    return out


def steps(records: list[dict[str, Any]]) -> list[int]:
    return [int(r["step"]) for r in records]


def trace(name: str, x: list[int], y: list[float | None], **style: Any) -> dict[str, Any]:
    return {"name": name, "x": x, "y": y, "smooth": True, "mode": "lines", **style}


def headline(runs: list[Run]) -> Panel:
    """The optimised reward (the weighted sum of the scorers) alone on its axis: each run's step
    mean (one run: with its min-max band), its validation, and the control's beside it."""
    traces = []
    for i, run in enumerate(runs):
        label = f"{run.label} (control, lr=0)" if run.is_control else run.label
        band = {"lo": values(run.train, "critic/rewards/min"), "hi": values(run.train, "critic/rewards/max")}
        traces.append(
            trace(
                label,
                steps(run.train),
                values(run.train, REWARD),
                color=i,
                **(band if len(runs) == 1 else {}),
            )
        )
        total = "val-core/total/reward/mean@1"
        if any(total in r for r in run.val):
            traces.append(trace(f"{label}: validation", steps(run.val), values(run.val, total), color=i,
                                smooth=False, mode="lines+markers", dash="dash"))  # fmt: skip
    note = "band: the step's lowest to highest sample" if len(runs) == 1 else ""
    return {"title": f"Optimised reward ({REWARD})", "y": "reward", "note": note, "traces": traces}


def paired_gain(runs: list[Run]) -> Panel | None:
    """Each trained run against the control, step by step, in per cent of the control's |reward|:
    the same prompts and noise at every step, so what differs is what was learnt."""
    controls = [r for r in runs if r.is_control]
    trained = [r for r in runs if not r.is_control]
    if not controls or not trained:
        return None
    control = {int(r["step"]): r.get(REWARD) for r in controls[0].train}
    traces = []
    for run in trained:
        x = [s for s in steps(run.train) if control.get(s) is not None]
        mine = {int(r["step"]): r.get(REWARD) for r in run.train}
        y = [_percent(control[s], mine[s]) for s in x]
        traces.append(trace(f"{run.label} against {controls[0].label}", x, y, color=runs.index(run)))
    return {"title": "Paired gain over the control", "y": "% of the control's |reward|",
            "note": "0: no better than not training", "traces": traces}  # fmt: skip


def scorer_panels(runs: list[Run]) -> list[Panel]:
    """Every scorer on its own axis as % change from its first step (training) and from step 0
    (validation): the optimised one rising while a weight-0 one drifts is reward hacking."""
    names: dict[str, float] = {}
    for run in runs:
        for name, weight in run.weights.items():
            names.setdefault(name, weight)
    panels = []
    for name, weight in names.items():
        traces = []
        for i, run in enumerate(runs):
            train = values(run.train, f"critic/score/{name}/mean")
            traces.append(trace(run.label, steps(run.train), _change_from_first(train), color=i))
            val = values(run.val, f"val-core/{name}/reward/mean@1")
            if any(v is not None for v in val):
                traces.append(trace(f"{run.label}: validation", steps(run.val), _change_from_first(val),
                                    color=i, smooth=False, mode="lines+markers", dash="dash"))  # fmt: skip
        role = "optimised" if weight else "weight 0: watched, not optimised"
        panels.append({"title": f"{name} ({role})", "y": "% change", "note": "", "traces": traces})
    return panels


ACCURACY_KEY = re.compile(r"^val-aux/(?P<scorer>[^/]+)/accuracy(?:/(?P<category>[^/]+))?/mean@1$")


def accuracy_panels(runs: list[Run]) -> list[Panel]:
    """A verifiable task's held-out accuracy (``val-aux/<scorer>/accuracy[/<category>]/mean@1``,
    the compose task's), one panel per category with every run on it, the overall one first:
    per category, where a gain comes from and what a run gives up for it."""
    found: dict[tuple[str, str], str] = {}
    for run in runs:
        for record in run.val:
            for key in record:
                if (match := ACCURACY_KEY.match(key)) is not None:
                    found[(match["scorer"], match["category"] or "")] = key
    panels = []
    for (scorer, category), key in sorted(found.items()):
        traces = [trace(f"{run.label} (control, lr=0)" if run.is_control else run.label, steps(run.val),
                        _percent_of(values(run.val, key)), color=i, smooth=False, mode="lines+markers",
                        **({"dash": "dash"} if run.is_control else {}))
                  for i, run in enumerate(runs)]  # fmt: skip
        title = f"{scorer}: {category.replace('_', ' ') if category else 'all categories'}"
        panels.append({"title": title, "y": "held-out accuracy, %", "note": key, "traces": traces})
    return panels


def _percent_of(series: list[float | None]) -> list[float | None]:
    return [None if v is None else 100.0 * v for v in series]


@dataclass
class Section:
    name: str
    panels: list[Panel]
    flat: list[tuple[str, str]]  # (key, what it was throughout): not plotted


def sections(runs: list[Run]) -> list[Section]:
    """Every metric of every run, one small panel each, grouped by the name's first part; the ones
    that are the same at every step of every run (an all-zero gap in a sync run) are only listed."""
    keys = sorted({k for run in runs for r in run.train for k in r if k not in NOT_METRICS})
    val_keys = sorted({k for run in runs for r in run.val for k in r if k not in NOT_METRICS})
    grouped: dict[str, Section] = {}
    for key, kind in [*((k, "train") for k in keys), *((k, "val") for k in val_keys)]:
        name = "validation" if kind == "val" else key.split("/", 1)[0]
        section = grouped.setdefault(name, Section(name, [], []))
        series = [(run, run.train if kind == "train" else run.val) for run in runs]
        said = flat_value([v for _, records in series for v in values(records, key)])
        if said is not None:
            section.flat.append((key, said))
            continue
        traces = [trace(run.label, steps(records), values(records, key),
                        **({} if kind == "train" else {"mode": "lines+markers", "smooth": False}))
                  for run, records in series]  # fmt: skip
        section.panels.append({"title": key, "y": "", "note": "", "traces": traces})
    order = {name: i for i, name in enumerate(SECTION_ORDER)}
    return sorted(grouped.values(), key=lambda s: (order.get(s.name, len(order)), s.name))


def flat_value(series: list[float | None]) -> str | None:
    """What a series that says nothing says (``"0 throughout"``), or None when it varies."""
    present = {v for v in series if v is not None}
    if not present:
        return "no value"
    if len(present) == 1:
        [value] = present
        return f"{value:.6g} throughout"
    return None


def _change_from_first(series: list[float | None]) -> list[float | None]:
    first = next((v for v in series if v is not None), None)
    return [None if first is None or v is None else _percent(first, v) for v in series]


def _percent(base: float | None, value: float | None) -> float | None:
    if base is None or value is None or base == 0:
        return None
    return (value - base) / abs(base) * 100.0


# --- the summary, the grids, the metadata, the config ---------------------------------------------


def summary_rows(runs: list[Run]) -> list[tuple[str, list[str]]]:
    """(what, one value per run): steps, the reward's first and last quarter, the change, and
    against the control when there is one."""
    quarters = [_quarters(values(run.train, REWARD)) for run in runs]
    rows = [
        ("steps", [str(run.train[-1]["step"]) for run in runs]),
        ("reward, first quarter of the steps", [f"{a:+.6g}" for a, _ in quarters]),
        ("reward, last quarter", [f"{b:+.6g}" for _, b in quarters]),
        ("change", [_fmt_change(a, b) for a, b in quarters]),
    ]
    controls = [i for i, run in enumerate(runs) if run.is_control]
    if controls and len(controls) < len(runs):
        base = quarters[controls[0]][1]
        against = [
            ("the control" if run.is_control else _fmt_change(base, q[1]))
            for run, q in zip(runs, quarters, strict=True)
        ]
        rows.append(("last quarter against the control's", against))
    for key in sorted({k for run in runs for r in run.val[-1:] for k in r if k.startswith("val-core/")}):
        rows.append((f"{key}, last validation", [_last(run.val, key) for run in runs]))
    return rows


def _quarters(series: list[float | None]) -> tuple[float, float]:
    present = [v for v in series if v is not None] or [math.nan]
    n = max(1, len(present) // 4)
    return sum(present[:n]) / n, sum(present[-n:]) / n


def _fmt_change(first: float, last: float) -> str:
    change = _percent(first, last)
    return "n/a" if change is None or math.isnan(change) else f"{change:+.1f}%"


def _last(records: list[dict[str, Any]], key: str) -> str:
    present = [(r["step"], r[key]) for r in records if r.get(key) is not None]
    return f"{present[-1][1]:+.6g} (step {present[-1][0]})" if present else ""


@dataclass
class Grid:
    step: int
    png_base64: str
    columns: int
    cells: list[dict[str, Any]]  # each cell's prompt and reward, row by row


def grid_cells(grid: Grid) -> list[str]:
    """Each cell of a grid as its own PNG (base64), row by row: the grid is ``columns`` images of
    one size side by side with no gap (``outputs.image_grid``)."""
    if not grid.cells:
        return []
    image = Image.open(io.BytesIO(base64.b64decode(grid.png_base64))).convert("RGB")
    columns = min(grid.columns, len(grid.cells))
    rows = -(-len(grid.cells) // grid.columns)
    width, height = image.width // columns, image.height // rows
    out = []
    for i in range(len(grid.cells)):
        row, column = divmod(i, grid.columns)
        buffer = io.BytesIO()
        box = (column * width, row * height, (column + 1) * width, (row + 1) * height)
        image.crop(box).save(buffer, "PNG")
        out.append(base64.b64encode(buffer.getvalue()).decode())
    return out


def grids(run: Run, tag: str) -> list[Grid]:
    """The run's ``images/<tag>_<step>.png`` grids with their captions; training ones thinned to
    :data:`MAX_TRAIN_GRIDS` evenly spaced."""
    paths = sorted((run.dir / "images").glob(f"{tag}_*.png"), key=lambda p: int(p.stem.rsplit("_", 1)[1]))
    paths = evenly_spaced(paths, MAX_TRAIN_GRIDS)
    out = []
    for path in paths:
        captions = path.with_suffix(".json")
        cells: dict[str, Any] = {"columns": 1, "cells": []}
        if captions.is_file():
            cells = json.loads(captions.read_text())
        data = base64.b64encode(path.read_bytes()).decode()
        out.append(Grid(int(path.stem.rsplit("_", 1)[1]), data, int(cells["columns"]), list(cells["cells"])))
    return out


def metadata_rows(runs: list[Run]) -> list[tuple[str, list[str]]]:
    """(what, one value per run): the command, version, commit, host, times (from sessions.jsonl;
    a run from before it was written: what its metrics and lock file say)."""
    rows: list[tuple[str, list[str]]] = [("folder", [str(run.dir.resolve()) for run in runs])]
    columns = [_metadata(run) for run in runs]
    for what in ("command", "version", "git commit", "host", "python", "started", "ended", "wall time",
                 "sessions"):  # fmt: skip
        rows.append((what, [c.get(what, "") for c in columns]))
    return rows


def _metadata(run: Run) -> dict[str, str]:
    first_time, last_time = run.train[0].get("time"), run.train[-1].get("time")
    if not run.sessions:  # a run from before sessions.jsonl: what its metrics and lock file say
        began = None if first_time is None else first_time - (run.train[0].get("timing_s/step") or 0.0)
        return {
            "host": str(_lock(run.dir).get("host", "")),
            "started": _when(began) + " (the first step's start)",
            "ended": _when(last_time) + " (the last step's end)",
            "wall time": "" if began is None or last_time is None else f"{last_time - began:.0f} s of steps",
            "sessions": "not recorded (a run from before sessions.jsonl)",
        }
    first, last = run.sessions[0], run.sessions[-1]
    wall = [s.wall_s for s in run.sessions if s.wall_s is not None]
    commits = {s.git_commit + (" (with uncommitted changes)" if s.git_dirty else "") for s in run.sessions}
    return {
        "command": "; ".join(dict.fromkeys(s.command for s in run.sessions if s.command)),
        "version": ", ".join(sorted({s.version for s in run.sessions})),
        "git commit": ", ".join(
            sorted(c or "none (the code was not committed in a git checkout)" for c in commits)
        ),
        "host": ", ".join(sorted({s.host for s in run.sessions})),
        "python": ", ".join(sorted({s.python for s in run.sessions})),
        "started": _when(first.started),
        "ended": _when(last.ended)
        if last.ended is not None
        else f"not recorded (last step {_when(last_time)})",
        "wall time": f"{sum(wall):.0f} s" + (f" (steps from {_when(first_time)})" if first_time else ""),
        "sessions": ", ".join(f"{s.status or 'no end recorded'}" for s in run.sessions),
    }


def _lock(run_dir: Path) -> dict[str, Any]:
    try:
        lock: dict[str, Any] = json.loads((run_dir / "run.lock").read_text())
    except (OSError, ValueError):
        return {}
    return lock


def _when(timestamp: Any) -> str:
    if timestamp is None:
        return ""
    import datetime

    moment = datetime.datetime.fromtimestamp(float(timestamp), tz=datetime.UTC)
    return moment.strftime("%Y-%m-%d %H:%M:%S UTC")


def flatten(tree: Any, prefix: str = "") -> dict[str, Any]:
    """``{"a": {"b": 1}}`` -> ``{"a.b": 1}``; lists are values."""
    if not isinstance(tree, dict):
        return {prefix: tree}
    out: dict[str, Any] = {}
    for key, value in tree.items():
        out.update(flatten(value, f"{prefix}.{key}" if prefix else str(key)))
    return out


def config_diff(base: dict[str, Any], other: dict[str, Any]) -> list[tuple[str, str, str]]:
    """(dotted key, base's value, other's value) of every key whose value differs; a key one of
    them lacks shows as ``(absent)``."""
    a, b = flatten(base), flatten(other)
    rows = []
    for key in sorted(set(a) | set(b)):
        if a.get(key, _ABSENT) != b.get(key, _ABSENT):
            rows.append((key, _show(a.get(key, _ABSENT)), _show(b.get(key, _ABSENT))))
    return rows


_ABSENT = object()


def _show(value: Any) -> str:
    return "(absent)" if value is _ABSENT else json.dumps(value)


def _saved_config(data: Any) -> dict[str, Any]:
    """A run's config.yaml as plain data in today's layout (an older version's run compares too)."""
    return upgraded_run_config(data) if isinstance(data, dict) else {}
