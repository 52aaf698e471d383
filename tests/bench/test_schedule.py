"""``flowgrpo bench schedule`` on a shortened demo (4 steps, 4 samples, in one process): both
schedules run, every per-step figure is over the 3 steps after the warm-up, and images/s and the
async/sync ratio recompute from the stored per-step metrics."""

from __future__ import annotations

import json
import statistics
from pathlib import Path

import pytest

from flowgrpo.models.bagel.checkpoint import make_tiny_bagel
from flowgrpo.services.bench import schedule

from .demo import SHORT_DEMO
from .figures import check_figures, median


def test_the_schedule_benchmark_reports_consistent_figures(tmp_path: Path) -> None:
    model = make_tiny_bagel(tmp_path / "model", seed=0)
    out = tmp_path / "schedule.json"
    options = ["--steps", "4", "--launcher", "inprocess", "--json", str(out)]
    argv = [*options, f"model.checkpoint={model}", *SHORT_DEMO]
    assert schedule.main(argv) == 0
    report = json.loads(out.read_text())
    check_figures(report)
    for mode in ("sync", "async"):
        r = report[mode]
        steady = r["steps"][1:]
        assert len(steady) == 3 == r["images_per_s"]["n"]
        rates = [m["trainer/samples"] / m["timing_s/step"] for m in steady]
        assert median(r["images_per_s"]) == pytest.approx(statistics.median(rates))
        assert set(r["phase_s"]) == set(schedule.PHASES)
        assert median(r["phase_s"]["timing_s/step"]) == pytest.approx(
            statistics.median(m["timing_s/step"] for m in steady)
        )
        assert set(r["busy_s"]) >= {"rollout", "trainer"}
    assert report["sync"]["overlap"] == 0.0 and report["sync"]["max_lag"] == 0
    assert report["async"]["max_lag"] <= 1
    ratio = median(report["async"]["images_per_s"]) / median(report["sync"]["images_per_s"])
    assert median(report["async_over_sync"]) == pytest.approx(ratio)


def test_too_few_steps_for_a_warm_up_and_three_figures_are_refused(
    capsys: pytest.CaptureFixture[str],
) -> None:
    with pytest.raises(SystemExit):
        schedule.main(["--steps", "3"])
    assert "0 (the recipe's) or >= 4" in capsys.readouterr().err
