"""``flowgrpo report RUN_DIR``: one self-contained HTML page of a run (plots and image grids
inside it as PNG data), written to ``<run_dir>/report.html``.

What it shows: the reward (mean, min-max band, validation), the loss and clip fraction, the
rollout/trainer log-prob gap, the policy lag, the time per step by phase, each service's busy
time per step (from the traces), the first (step 0) and last validation grids side by side with
each cell's prompt and its reward at both, the validations in between,
and the resolved config. Torch-free (matplotlib, Agg backend).
"""

from __future__ import annotations

import base64
import html
import io
import json
import math
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import yaml

from flowgrpo.services.coordinator.outputs import read_metrics
from flowgrpo.services.coordinator.trace import busy_per_step

REPORT_FILE = "report.html"
COUNTS = (
    "coordinator/dropped_groups",
    "coordinator/stale_groups",
    "coordinator/retries",
    "coordinator/rejoins",
)
STYLE = """body{font-family:system-ui,sans-serif;max-width:1100px;margin:2em auto;padding:0 1em}
table{border-collapse:collapse;margin:.5em 0}td,th{border:1px solid #ccc;padding:.25em .6em;text-align:left}
img{max-width:100%}.plots,.pair{display:grid;grid-template-columns:1fr 1fr;gap:1em}
pre{background:#f6f6f6;padding:1em;overflow:auto;font-size:.85em}figcaption{color:#555;font-size:.9em}"""


def write_report(run_dir: str | Path) -> Path:
    """Render the report of ``run_dir``; returns the file written."""
    run_dir = Path(run_dir)
    if not (run_dir / "config.yaml").is_file():
        raise FileNotFoundError(f"{run_dir} is not a run folder (no config.yaml): give the run_dir of a run")
    train, val = read_metrics(run_dir), read_metrics(run_dir, kind="val")
    if not train:
        raise ValueError(f"{run_dir} has no training steps in metrics.jsonl yet: nothing to report")
    sections = [
        f"<h1>Run {html.escape(run_dir.resolve().name)}</h1>",
        _summary(train, val),
        "<h2>Training</h2>",
        '<div class="plots">' + "".join(_figure(*plot) for plot in _plots(train, val, run_dir)) + "</div>",
        _validation(run_dir, val),
        "<h2>Resolved config</h2>",
        f"<pre>{html.escape((run_dir / 'config.yaml').read_text())}</pre>",
    ]
    page = (
        f"<!doctype html><html><head><meta charset='utf-8'><title>FlowGRPO run {html.escape(run_dir.name)}"
        f"</title><style>{STYLE}</style></head><body>{''.join(sections)}</body></html>\n"
    )
    out = run_dir / REPORT_FILE
    out.write_text(page, encoding="utf-8")
    return out


# --- the parts -----------------------------------------------------------------------------------


def _summary(train: list[dict[str, Any]], val: list[dict[str, Any]]) -> str:
    rewards, last_step = [m["critic/rewards/mean"] for m in train], train[-1]
    window = max(1, min(4, len(rewards) // 2))
    first, last = sum(rewards[:window]) / window, sum(rewards[-window:]) / window
    rows = [
        ("steps", f"{train[-1]['step']}"),
        (f"mean reward, first {window} steps", f"{first:+.6g}"),
        (f"mean reward, last {window} steps", f"{last:+.6g} ({_change(first, last)})"),
        ("seconds per step (median)", f"{_median([m['timing_s/step'] for m in train]):.3g}"),
        (
            "dropped / stale groups, retries, rejoins",
            " / ".join(f"{last_step.get(k) or 0:.0f}" for k in COUNTS),
        ),
    ]
    for record in val[-1:]:
        for key, value in record.items():
            if key.startswith("val-core/") and value is not None:
                rows.append((f"{key} (step {record['step']})", f"{value:+.6g}"))
    return (
        "<table>" + "".join(f"<tr><th>{html.escape(k)}</th><td>{v}</td></tr>" for k, v in rows) + "</table>"
    )


def _plots(train: list[dict[str, Any]], val: list[dict[str, Any]], run_dir: Path) -> list[tuple[str, str]]:
    """(caption, PNG data) of each plot."""
    import matplotlib

    matplotlib.use("Agg")
    from matplotlib import pyplot as plt
    from matplotlib.ticker import MaxNLocator

    steps = [m["step"] for m in train]

    def series(key: str) -> list[float]:
        return [math.nan if m.get(key) is None else float(m[key]) for m in train]

    def plot(caption: str, draw: Any) -> tuple[str, str]:
        fig, ax = plt.subplots(figsize=(5.4, 3.2), dpi=100)
        draw(ax)
        ax.set_xlabel("step")
        ax.xaxis.set_major_locator(MaxNLocator(integer=True))
        ax.grid(alpha=0.3)
        if ax.get_legend_handles_labels()[0]:
            ax.legend(fontsize=8)
        fig.tight_layout()
        buffer = io.BytesIO()
        fig.savefig(buffer, format="png")
        plt.close(fig)
        return caption, base64.b64encode(buffer.getvalue()).decode()

    def reward(ax: Any) -> None:
        ax.fill_between(
            steps, series("critic/rewards/min"), series("critic/rewards/max"), alpha=0.2, label="min-max"
        )
        ax.plot(steps, series("critic/rewards/mean"), label="mean")
        for key in sorted({k for r in val for k in r if k.startswith("val-core/")}):
            ax.plot(
                [r["step"] for r in val], [r[key] for r in val], "o--", label=key.removeprefix("val-core/")
            )
        ax.set_ylabel("reward")

    def loss(ax: Any) -> None:
        ax.plot(steps, series("actor/pg_loss"), label="loss")
        ax.set_ylabel("loss")
        twin = ax.twinx()
        twin.plot(steps, series("actor/pg_clipfrac"), color="C1", label="clip fraction")
        twin.set_ylabel("clip fraction", color="C1")

    def gap(ax: Any) -> None:
        for key in ("actor/rollout_logp_gap/mean", "actor/rollout_logp_gap/max"):
            ax.plot(steps, series(key), label=key.rsplit("/", 1)[-1])
        ax.set_ylabel("|log p rollout - log p trainer|")
        if any(v > 0 for v in series("actor/rollout_logp_gap/max") if not math.isnan(v)):
            ax.set_yscale("log")

    def lag(ax: Any) -> None:
        ax.step(steps, series("trainer/lag/max"), where="mid", label="max")
        ax.plot(steps, series("trainer/lag/mean"), label="mean")
        ax.set_ylabel("policy lag (versions)")

    def timing(ax: Any) -> None:
        for key in ("timing_s/step", "timing_s/gen_and_reward", "timing_s/train", "timing_s/load_weights"):
            ax.plot(steps, series(key), label=key.removeprefix("timing_s/"))
        ax.set_ylabel("seconds")

    plots = [
        plot("Reward per step (band: min to max of the step's samples; dashed: validation)", reward),
        plot("Policy loss and the fraction of clipped ratios", loss),
        plot("Rollout/trainer log-prob gap of the same samples", gap),
        plot("Policy lag of the trained samples (async: <= eta)", lag),
        plot("Time per step by phase (async phases overlap)", timing),
    ]
    weights = _scorer_weights(run_dir)
    if weights:
        caption = (
            "Reward-hacking monitor: each scorer's mean against step 1 (dashed: weight 0, not optimised)"
        )
        plots.append(plot(caption, _monitor(steps, series, weights)))
    busy = _busy_per_service(run_dir, steps)
    if busy:
        plots.append(plot("Each service's busy time per step (from the traces)", _services(steps, busy)))
    return plots


def _services(steps: list[int], busy: dict[str, list[float]]) -> Any:
    def draw(ax: Any) -> None:
        for name, values in sorted(busy.items()):
            ax.plot(steps, values, label=name)
        ax.set_ylabel("busy seconds per step")

    return draw


def _monitor(steps: list[int], series: Any, weights: dict[str, float]) -> Any:
    """Draws each scorer's per-step mean minus its step-1 value: the optimised reward rising while
    a held-out scorer or an image statistic drifts is what reward hacking looks like."""

    def draw(ax: Any) -> None:
        for name, weight in weights.items():
            values = series(f"critic/score/{name}/mean")
            first = next((v for v in values if not math.isnan(v)), math.nan)
            label = f"{name} ({'optimised' if weight else 'held out'})"
            ax.plot(steps, [v - first for v in values], "-" if weight else "--", label=label)
        ax.axhline(0.0, color="grey", linewidth=0.8)
        ax.set_ylabel("mean score - its step-1 value")

    return draw


def _scorer_weights(run_dir: Path) -> dict[str, float]:
    """Each scorer of the run's reward and its weight, from the resolved config."""
    config = yaml.safe_load((run_dir / "config.yaml").read_text()) or {}
    scorers = (config.get("reward") or {}).get("scorers") or []
    return {
        str(s["name"]): float(s.get("weight", 1.0)) for s in scorers if isinstance(s, dict) and "name" in s
    }


def _busy_per_service(run_dir: Path, steps: Sequence[int]) -> dict[str, list[float]]:
    if not (run_dir / "traces").is_dir():
        return {}
    per_step = busy_per_step(str(run_dir), list(steps))
    names = {name for busy in per_step for name in busy}
    return {name: [busy.get(name, 0.0) for busy in per_step] for name in names}


def _validation(run_dir: Path, val: list[dict[str, Any]]) -> str:
    """The first validation (step 0: before any update) and the last side by side, with each
    cell's prompt and its reward at both; every validation in between below, folded."""
    parts = ["<h2>Validation</h2>"]
    grids = sorted((run_dir / "images").glob("val_*.png"), key=lambda g: int(g.stem.split("_")[-1]))
    if not grids:
        return "".join(parts) + "<p>No validation in this run (schedule.eval_every=0 or not reached).</p>"
    by_step = {r["step"]: r for r in val}
    first, last = grids[0], grids[-1]
    pair = [first, last] if first != last else [first]
    parts.append(
        "<p>The same prompts and the same initial noise every time (ODE sampling): "
        "what differs between the grids is what the policy learnt.</p>"
    )
    parts.append('<div class="pair">' + "".join(_validation_grid(g, by_step) for g in pair) + "</div>")
    parts.append(_validation_cells(first, last))
    between = grids[1:-1]
    if between:
        inner = "".join(_validation_grid(g, by_step) + _validation_cells(g) for g in between)
        parts.append(f"<details><summary>{len(between)} validation(s) in between</summary>{inner}</details>")
    return "".join(parts)


def _grid_step(grid: Path) -> int:
    return int(grid.stem.split("_")[-1])


def _validation_grid(grid: Path, by_step: dict[int, dict[str, Any]]) -> str:
    step = _grid_step(grid)
    scores = ", ".join(f"{k.removeprefix('val-core/')} {v:+.6g}" for k, v in by_step.get(step, {}).items()
                       if k.startswith("val-core/") and v is not None)  # fmt: skip
    label = "before training" if step == 0 else f"after step {step}"
    figure = _figure(f"validation at step {step}", base64.b64encode(grid.read_bytes()).decode())
    return f"<div><h3>Step {step} ({label})</h3><p>{html.escape(scores)}</p>{figure}</div>"


def _cells(grid: Path) -> tuple[int, list[dict[str, Any]]]:
    captions = grid.with_suffix(".json")
    if not captions.is_file():
        return 1, []
    cells = json.loads(captions.read_text())
    return int(cells["columns"]), list(cells["cells"])


def _validation_cells(grid: Path, later: Path | None = None) -> str:
    """Each cell's prompt and reward at ``grid``'s step (and at ``later``'s, with the change)."""
    columns, cells = _cells(grid)
    after = _cells(later)[1] if later is not None else []
    if not cells:
        return ""
    head = ["row, column", "prompt", f"reward at step {_grid_step(grid)}"]
    if later is not None and len(after) == len(cells):
        head += [f"at step {_grid_step(later)}", "change"]
    rows = []
    for i, cell in enumerate(cells):
        values = [f"{i // columns + 1}, {i % columns + 1}", html.escape(cell["prompt"]), _reward(cell)]
        if len(head) > 3:
            first, last = cell.get("reward"), after[i].get("reward")
            change = "" if first is None or last is None else _change(first, last)
            values += [_reward(after[i]), change]
        rows.append("<tr>" + "".join(f"<td>{v}</td>" for v in values) + "</tr>")
    header = "".join(f"<th>{h}</th>" for h in head)
    return f"<table><tr>{header}</tr>{''.join(rows)}</table>"


def _reward(cell: dict[str, Any]) -> str:
    return "" if cell.get("reward") is None else format(cell["reward"], "+.6g")


def _figure(caption: str, png_base64: str) -> str:
    return (
        f"<figure><img alt='{html.escape(caption)}' src='data:image/png;base64,{png_base64}'>"
        f"<figcaption>{html.escape(caption)}</figcaption></figure>"
    )


def _median(values: list[float]) -> float:
    ordered = sorted(values)
    return ordered[len(ordered) // 2]


def _change(first: float, last: float) -> str:
    return f"{(last - first) / abs(first) * 100:+.1f}%" if first else "n/a"
