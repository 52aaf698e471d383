"""Honest figures for every benchmark: a timed figure is the median of at least ``MIN_REPEATS``
timed runs after at least one warm-up run, printed and stored with its range and its count,
``1.27 images/s (1.18-1.30, n=5)``.

A :class:`Figure` is measured (:func:`timed`, :func:`run_timed`, :meth:`Figure.of`) or derived
from measured ones, and a derived figure's range is the range its inputs allow: a rate
``amount / seconds`` (:meth:`Figure.per`) runs from ``amount / max`` to ``amount / min``, a
ratio of two figures (:func:`ratio`) from ``num.min / den.max`` to ``num.max / den.min``, a sum
adds the ranges. So ``rate.median * seconds.median == amount`` exactly, and every ratio in a
report recomputes from the medians stored beside it.

One-off costs that cannot be repeated (loading a model, the first compiled call) are plain
seconds under a key ``once_s`` of the report, never a :class:`Figure`.

Torch-free: the bus and schedule benchmarks use it where torch is absent; torch is imported only
to time on a CUDA device (CUDA events on its current stream, the device synchronised first).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import statistics
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, Generic, TypeVar

if TYPE_CHECKING:
    import torch

MIN_REPEATS = 3
T = TypeVar("T")


@dataclass(frozen=True)
class Figure:
    """The median of ``n`` values, their smallest and largest, in ``unit``; ``values``: the
    measured values themselves (empty for a derived figure or a long series)."""

    median: float
    min: float
    max: float
    n: int
    unit: str = "s"
    values: tuple[float, ...] = ()

    @classmethod
    def of(cls, values: Sequence[float], unit: str = "s", *, keep: bool = True) -> Figure:
        if not values:
            raise ValueError("a figure needs at least one value")
        kept = tuple(float(v) for v in values) if keep else ()
        return cls(float(statistics.median(values)), float(min(values)), float(max(values)),
                   len(values), unit, kept)  # fmt: skip

    def per(self, amount: float, unit: str) -> Figure:
        """``amount / self`` (e.g. images per second of these seconds); the range flips."""
        return Figure(_div(amount, self.median), _div(amount, self.max), _div(amount, self.min), self.n, unit)

    def scaled(self, factor: float, unit: str) -> Figure:
        """``self x factor`` for a factor > 0 (seconds to milliseconds, FLOP/s to MFU)."""
        if factor <= 0:
            raise ValueError(f"scale factor {factor} must be > 0")
        return Figure(self.median * factor, self.min * factor, self.max * factor, self.n, unit)

    def to_json(self) -> dict[str, Any]:
        out: dict[str, Any] = {"median": self.median, "min": self.min, "max": self.max, "n": self.n}
        out["unit"] = self.unit
        if self.values:
            out["values"] = list(self.values)
        return out

    def __format__(self, spec: str) -> str:
        """``f"{fig:.2f}"`` -> ``1.27 images/s (1.18-1.30, n=5)``; a ``%`` spec drops the unit."""
        spec = spec or ".4g"
        unit = "" if spec.endswith("%") or not self.unit else f" {self.unit}"
        lo, hi = format(self.min, spec), format(self.max, spec)
        return f"{self.median:{spec}}{unit} ({lo}-{hi}, n={self.n})"

    def __str__(self) -> str:
        return format(self)

    def brief(self, spec: str) -> str:
        """``1.27 (1.18-1.30)``: a table cell (the unit and n in the table's header)."""
        return f"{self.median:{spec}} ({self.min:{spec}}-{self.max:{spec}})"


def ratio(num: Figure, den: Figure, unit: str = "x") -> Figure:
    """``num / den`` at the medians; the range is what the two ranges allow; n: the smaller n."""
    return Figure(_div(num.median, den.median), _div(num.min, den.max), _div(num.max, den.min),
                  min(num.n, den.n), unit)  # fmt: skip


def total(parts: Sequence[Figure], unit: str = "s") -> Figure:
    """The sum of figures measured apart (e.g. sampling + decoding): medians and ranges add."""
    return Figure(sum(p.median for p in parts), sum(p.min for p in parts), sum(p.max for p in parts),
                  min(p.n for p in parts), unit)  # fmt: skip


def _div(a: float, b: float) -> float:
    return a / b if b > 0 else math.inf


# --- timing ---------------------------------------------------------------------------------------


@dataclass
class Runs(Generic[T]):
    """What :func:`run_timed` measured: the timed runs' seconds and every call's return value."""

    seconds: Figure
    outputs: list[T]  # of the timed runs, in order
    warmup: list[T]  # of the warm-up runs
    warmup_seconds: list[float]


def check_repeats(repeats: int, warmup: int) -> None:
    if repeats < MIN_REPEATS or warmup < 1:
        raise ValueError(
            f"a timed figure needs >= {MIN_REPEATS} timed runs after >= 1 warm-up run "
            f"(got {repeats} after {warmup})"
        )


def time_call(fn: Callable[[], T], device: torch.device | None = None) -> tuple[float, T]:
    """Seconds of one call of ``fn`` and its result. On a CUDA device: CUDA events around it on
    the device's current stream, the device synchronised first (so the start event runs at once
    and host work inside ``fn`` counts) and the end event waited for; else the wall clock."""
    if device is None or device.type != "cuda":
        begin = time.perf_counter()
        out = fn()
        return time.perf_counter() - begin, out
    import torch

    stream = torch.cuda.current_stream(device)
    start = torch.cuda.Event(enable_timing=True)  # type: ignore[no-untyped-call]
    end = torch.cuda.Event(enable_timing=True)  # type: ignore[no-untyped-call]
    torch.cuda.synchronize(device)
    start.record(stream)
    out = fn()
    end.record(stream)
    end.synchronize()
    return start.elapsed_time(end) / 1e3, out


def run_timed(
    fn: Callable[[], T],
    *,
    repeats: int = MIN_REPEATS,
    warmup: int = 1,
    device: torch.device | None = None,
    between: Callable[[T], object] | None = None,
) -> Runs[T]:
    """``warmup`` untimed calls, then ``repeats`` timed ones (:func:`time_call`); ``between``
    gets each call's result, outside the clock (e.g. a consumer taking what the call published)."""
    check_repeats(repeats, warmup)
    warm, outputs, seconds, warm_seconds = [], [], [], []
    for i in range(warmup + repeats):
        took, out = time_call(fn, device)
        if i < warmup:
            warm.append(out)
            warm_seconds.append(took)
        else:
            outputs.append(out)
            seconds.append(took)
        if between is not None:
            between(out)
    return Runs(Figure.of(seconds), outputs, warm, warm_seconds)


def timed(
    fn: Callable[[], object],
    *,
    repeats: int = MIN_REPEATS,
    warmup: int = 1,
    device: torch.device | None = None,
) -> Figure:
    """Seconds of ``fn``: :func:`run_timed` without the results."""
    return run_timed(fn, repeats=repeats, warmup=warmup, device=device).seconds


def repeats_arg(text: str) -> int:
    """argparse type of a ``--repeats`` option: an integer >= MIN_REPEATS."""
    value = int(text)
    if value < MIN_REPEATS:
        raise argparse.ArgumentTypeError(f"{value} < {MIN_REPEATS}: every figure is a median of >= 3 runs")
    return value


# --- reports ---------------------------------------------------------------------------------------


def to_jsonable(value: object) -> Any:
    """Objects with a ``to_json`` (figures) as what it returns, dataclasses as dicts of their
    fields, recursively; a non-finite float as null; anything else unknown as ``str``."""
    to_json = getattr(value, "to_json", None)
    if callable(to_json):
        return to_jsonable(to_json())
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        return {f.name: to_jsonable(getattr(value, f.name)) for f in dataclasses.fields(value)}
    if isinstance(value, dict):
        return {str(k): to_jsonable(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [to_jsonable(v) for v in value]
    if isinstance(value, float) and not math.isfinite(value):
        return None  # JSON has no infinity (a threshold never reached) nor NaN
    if value is None or isinstance(value, bool | int | float | str):
        return value
    return str(value)


def write_json(path: str | Path | None, report: object) -> None:
    """Write ``report`` (figures, dataclasses, plain values) as indented JSON; no path: nothing."""
    if path:
        Path(path).write_text(json.dumps(to_jsonable(report), indent=2) + "\n")
