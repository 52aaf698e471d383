"""Checks every benchmark's JSON must pass: each figure is the median of >= 3 runs inside its
range, and every key that names a timing (or something derived from one) holds a figure."""

from __future__ import annotations

import math
import re
import statistics
from collections.abc import Iterator
from typing import Any

import pytest

NOT_MEASURED = {"args", "steps", "goals", "once_s"}  # options, raw per-step records, targets, one-offs


def is_figure(value: Any) -> bool:
    return isinstance(value, dict) and {"median", "min", "max", "n"} <= value.keys()


def only_figures(value: Any) -> bool:
    """A figure, or a non-empty table (dict) of them, nested or not."""
    if is_figure(value):
        return True
    return isinstance(value, dict) and bool(value) and all(only_figures(v) for v in value.values())


def names_a_timing(key: str) -> bool:
    """Seconds, rates, ratios and utilisations: what must be a figure wherever it appears."""
    if key == "p99_us":  # a percentile of the same runs, stored beside their figure
        return False
    return (
        key.endswith(("_s", "_us", "_ms"))
        or re.search(r"per_s($|_)", key) is not None
        or "_over_" in key
        or key in {"seconds", "ratio", "ms", "tflops", "mfu"}
        or key.startswith(("mfu_", "hfu_"))
    )


def walk(value: Any, path: str = "") -> Iterator[tuple[str, Any]]:
    yield path, value
    if isinstance(value, dict) and not is_figure(value):
        for key, item in value.items():
            if key not in NOT_MEASURED:
                yield from walk(item, f"{path}.{key}")
    elif isinstance(value, list):
        for i, item in enumerate(value):
            yield from walk(item, f"{path}[{i}]")


def check_figures(report: Any, min_n: int = 3) -> list[dict[str, Any]]:
    """Assert the rules on every figure of ``report``; returns the figures found."""
    found = []
    for path, value in walk(report):
        key = path.rsplit(".", 1)[-1]
        if names_a_timing(key) and not key.startswith("["):
            assert only_figures(value), f"{path} is not a figure (nor a table of them): {value!r}"
        if is_figure(value):
            found.append(value)
            assert value["n"] >= min_n, f"{path}: n = {value['n']}"
            assert value["min"] <= value["median"] <= value["max"], f"{path}: {value}"
            assert all(math.isfinite(value[k]) for k in ("median", "min", "max")), f"{path}: {value}"
            if "values" in value:
                values = value["values"]
                assert len(values) == value["n"], path
                assert value["median"] == pytest.approx(statistics.median(values), rel=1e-12), path
                assert (value["min"], value["max"]) == (min(values), max(values)), path
    assert found, "no figures in the report"
    return found


def median(figure: dict[str, Any]) -> float:
    assert is_figure(figure), figure
    return float(figure["median"])
