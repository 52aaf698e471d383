"""``flowgrpo compare RUN_A RUN_B [...]``: did a change of launcher, replica count or schedule keep
training the same? Per metric, over the steps all runs have: the largest absolute and relative
difference from the first run, and the first step where they part (beyond ``atol`` / ``rtol``;
0 / 0 asks for bitwise equality). Wall-clock keys (``timestamp_s/``, ``timing_s/``, ``perf/``)
differ by nature and are left out unless asked for, like the weight publication's transport
figures (``publication/``: bytes and replica counts of a launcher and a replica count, not of
training)."""

from __future__ import annotations

import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from flowgrpo.services.coordinator.outputs import read_metrics

CLOCK_PREFIXES = ("timestamp_s/", "timing_s/", "perf/", "publication/")


@dataclass(frozen=True)
class KeyDiff:
    key: str
    run: str  # the run compared with the first
    max_abs: float
    max_rel: float
    first_step: int | None  # the first step beyond the tolerance; None: equal throughout


@dataclass(frozen=True)
class Comparison:
    runs: list[str]
    steps: list[int]  # the steps every run has
    keys: list[str]  # the keys compared
    diffs: list[KeyDiff]
    only_in_some: list[str]  # keys some runs lack (not compared)

    @property
    def identical(self) -> bool:
        return all(d.first_step is None for d in self.diffs)

    def first_parting(self) -> KeyDiff | None:
        parted = [d for d in self.diffs if d.first_step is not None]
        return min(parted, key=lambda d: (d.first_step, d.key)) if parted else None


def compare_runs(
    run_dirs: list[str | Path], atol: float = 0.0, rtol: float = 0.0, clock: bool = False
) -> Comparison:
    if len(run_dirs) < 2:
        raise ValueError("compare needs at least two run folders")
    metrics = []
    for run_dir in run_dirs:
        records = read_metrics(run_dir)
        if not records:
            raise FileNotFoundError(f"{run_dir}: no training steps in metrics.jsonl (is it a run folder?)")
        metrics.append({int(r["step"]): r for r in records})
    steps = sorted(set.intersection(*(set(m) for m in metrics)))
    if not steps:
        raise ValueError("the runs have no step in common")
    key_sets = [{k for r in m.values() for k in r if _compared(k, clock)} for m in metrics]
    keys = sorted(set.intersection(*key_sets))
    only = sorted(set.union(*key_sets) - set(keys))
    diffs = [
        _diff(key, str(run_dirs[i]), metrics[0], metrics[i], steps, atol=atol, rtol=rtol)
        for i in range(1, len(metrics))
        for key in keys
    ]
    return Comparison([str(r) for r in run_dirs], steps, keys, diffs, only)


def _compared(key: str, clock: bool) -> bool:
    return key not in ("kind", "step", "time") and (clock or not key.startswith(CLOCK_PREFIXES))


def _diff(
    key: str,
    run: str,
    base: dict[int, Any],
    other: dict[int, Any],
    steps: list[int],
    *,
    atol: float,
    rtol: float,
) -> KeyDiff:
    max_abs = max_rel = 0.0
    first = None
    for step in steps:
        a, b = _number(base[step].get(key)), _number(other[step].get(key))
        if math.isnan(a) and math.isnan(b):
            continue
        delta = abs(a - b) if not (math.isnan(a) or math.isnan(b)) else math.inf
        rel = (
            delta / max(abs(a), abs(b)) if delta and max(abs(a), abs(b)) else (0.0 if not delta else math.inf)
        )
        max_abs, max_rel = max(max_abs, delta), max(max_rel, rel)
        if first is None and delta > atol + rtol * abs(a):
            first = step
    return KeyDiff(key, run, max_abs, max_rel, first)


def _number(value: Any) -> float:
    return math.nan if value is None else float(value)


def format_comparison(result: Comparison, show: int = 40) -> str:
    span = f"{len(result.steps)} ({result.steps[0]}..{result.steps[-1]})"
    lines = [f"runs: {', '.join(result.runs)} (differences from the first)",
             f"steps compared: {span}, keys: {len(result.keys)}"]  # fmt: skip
    if result.only_in_some:
        lines.append(f"not in every run (not compared): {', '.join(result.only_in_some)}")
    parting = result.first_parting()
    if parting is None:
        lines.append("identical: every compared key equal at every common step")
        return "\n".join(lines)
    lines.append(f"they part at step {parting.first_step} ({parting.key}, {parting.run})")
    lines.append(f"{'key':<40} {'run':<28} {'max |diff|':>12} {'max rel':>10} {'first step':>10}")
    differing = sorted(
        (d for d in result.diffs if d.first_step is not None), key=lambda d: (d.first_step, d.key)
    )
    for d in differing[:show]:
        lines.append(
            f"{d.key:<40} {Path(d.run).name[:28]:<28} {d.max_abs:12.4g} {d.max_rel:10.3g} {d.first_step:>10}"
        )
    if len(differing) > show:
        lines.append(f"... and {len(differing) - show} more keys")
    equal = sum(d.first_step is None for d in result.diffs)
    lines.append(f"{equal} of {len(result.diffs)} (key, run) pairs equal throughout")
    return "\n".join(lines)


def plot_comparison(result: Comparison, path: str | Path, keys: tuple[str, ...] = ()) -> Path:
    """Each key's curve per run, and its |difference| from the first run, as one PNG."""
    import matplotlib

    matplotlib.use("Agg")
    from matplotlib import pyplot as plt

    keys = keys or tuple(
        k for k in ("critic/rewards/mean", "actor/pg_loss", "actor/grad_norm") if k in result.keys
    )
    runs = [{int(r["step"]): r for r in read_metrics(run)} for run in result.runs]
    fig, axes = plt.subplots(2, len(keys), figsize=(4.5 * len(keys), 6), dpi=100, squeeze=False)
    for column, key in enumerate(keys):
        top, bottom = axes[0][column], axes[1][column]
        for run, metrics in zip(result.runs, runs, strict=True):
            top.plot(result.steps, [_number(metrics[s].get(key)) for s in result.steps], label=Path(run).name)
        for run, metrics in zip(result.runs[1:], runs[1:], strict=True):
            gaps = [abs(_number(metrics[s].get(key)) - _number(runs[0][s].get(key))) for s in result.steps]
            bottom.plot(result.steps, gaps, label=Path(run).name)
        top.set_title(key, fontsize=9)
        bottom.set_ylabel("|difference from the first run|", fontsize=8)
        bottom.set_xlabel("step")
        top.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)
    return Path(path)
