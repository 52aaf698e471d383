"""The statistics every benchmark reports through (services/bench/stats.py): exact arithmetic."""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import pytest

from flowgrpo.services.bench.stats import (
    Figure,
    check_repeats,
    ratio,
    repeats_arg,
    run_timed,
    timed,
    total,
    write_json,
)


def test_a_figure_is_the_median_and_range_of_its_values() -> None:
    f = Figure.of([0.922, 0.833, 0.768, 0.807])  # four rollouts on an H200: the first is no figure
    assert (f.median, f.min, f.max, f.n) == (pytest.approx(0.82), 0.768, 0.922, 4)
    assert f"{f:.2f}" == "0.82 s (0.77-0.92, n=4)"
    assert f.brief(".1f") == "0.8 (0.8-0.9)"
    assert f"{Figure.of([0.5, 0.25, 0.75], 'MFU'):.1%}" == "50.0% (25.0%-75.0%, n=3)"
    assert Figure.of([3.0, 1.0, 2.0], keep=False).values == ()


def test_derived_figures_keep_their_products_and_their_ranges() -> None:
    seconds = Figure.of([2.0, 4.0, 5.0])
    rate = seconds.per(8, "images/s")  # a rate's range flips: the slowest run is the lowest rate
    assert (rate.median, rate.min, rate.max, rate.n, rate.unit) == (2.0, 1.6, 4.0, 3, "images/s")
    assert rate.median * seconds.median == 8
    assert seconds.scaled(1e3, "ms").min == 2000.0
    r = ratio(Figure.of([1.0, 2.0, 3.0]), Figure.of([4.0, 4.0, 8.0]))
    assert (r.median, r.min, r.max) == (0.5, 1 / 8, 3 / 4)
    both = total([Figure.of([1.0, 2.0, 3.0]), Figure.of([10.0, 20.0, 30.0])])
    assert (both.median, both.min, both.max) == (22.0, 11.0, 33.0)
    with pytest.raises(ValueError, match="must be > 0"):
        seconds.scaled(0, "x")


def test_run_timed_warms_up_then_times_and_hands_every_result_on() -> None:
    calls: list[int] = []
    seen: list[int] = []

    def fn() -> int:
        calls.append(len(calls))
        return calls[-1]

    runs = run_timed(fn, repeats=3, warmup=2, between=seen.append)
    assert runs.warmup == [0, 1] and runs.outputs == [2, 3, 4] and seen == [0, 1, 2, 3, 4]
    assert runs.seconds.n == 3 == len(runs.seconds.values) and len(runs.warmup_seconds) == 2
    assert timed(lambda: None).n == 3


@pytest.mark.parametrize(("repeats", "warmup"), [(2, 1), (3, 0)])
def test_fewer_than_three_timed_runs_or_no_warm_up_is_refused(repeats: int, warmup: int) -> None:
    with pytest.raises(ValueError, match=">= 3 timed runs after >= 1 warm-up"):
        check_repeats(repeats, warmup)
    with pytest.raises(ValueError):
        run_timed(lambda: None, repeats=repeats, warmup=warmup)
    with pytest.raises(argparse.ArgumentTypeError):
        repeats_arg("2")
    assert repeats_arg("3") == 3


def test_reports_are_written_with_every_figure_as_a_dict(tmp_path: Path) -> None:
    path = tmp_path / "r.json"
    write_json(path, {"a": [Figure.of([1.0, 2.0, 3.0])], "b": (1, "x"), "c": None})
    assert json.loads(path.read_text()) == {
        "a": [{"median": 2.0, "min": 1.0, "max": 3.0, "n": 3, "unit": "s", "values": [1.0, 2.0, 3.0]}],
        "b": [1, "x"],
        "c": None,
    }
    write_json(None, {})  # no path: nothing written, no error
