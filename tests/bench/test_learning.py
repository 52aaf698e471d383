"""``flowgrpo bench learning`` for one seed on a shortened demo: the trained run and its lr=0
control are paired (the same first step), and every figure of the row recomputes from the
stored per-step rewards. ``flowgrpo bench paths``: its page, and the refusal of --replot alone
(its runs are tested in tests/coordinator/test_train.py)."""

from __future__ import annotations

import json
import statistics
from pathlib import Path

import pytest

from flowgrpo.models.bagel.checkpoint import make_tiny_bagel
from flowgrpo.services.bench import learning, paths

from .demo import SHORT_DEMO

SHORT = ["schedule.steps=4", *SHORT_DEMO]


def test_the_learning_benchmark_pairs_each_run_with_its_control(tmp_path: Path) -> None:
    model = make_tiny_bagel(tmp_path / "model", seed=0)
    out = tmp_path / "learning.json"
    argv = ["--seeds", "0", "--threads", "1", "--jobs", "2", "--json", str(out), f"model.checkpoint={model}"]
    assert learning.main([*argv, *SHORT]) == 0
    report = json.loads(out.read_text())
    [row] = report["rows"]
    trained, control = (
        report["rewards"]["seed0-native-t1-trained"],
        report["rewards"]["seed0-native-t1-control"],
    )
    assert len(trained) == len(control) == 4 and trained[0] == control[0]  # step 1 precedes any update
    quarter = 2  # max(4 // 4, 2)
    assert row["first_quarter"] == pytest.approx(statistics.fmean(trained[:quarter]))
    assert row["last_quarter"] == pytest.approx(statistics.fmean(trained[-quarter:]))
    gain = statistics.fmean(t - c for t, c in zip(trained[-quarter:], control[-quarter:], strict=True))
    assert row["gain"] == pytest.approx(gain)
    assert row["gain_over_spread"] == pytest.approx(gain / statistics.stdev(control))
    assert row["digest"] == learning.digest(trained)
    assert set(row["once_s"]) == {"trained_run", "control_run"}


def test_the_paths_benchmark_page_and_its_options(capsys: pytest.CaptureFixture[str]) -> None:
    text = paths.page("| path | ... |", 40, "sync-paths.png")
    assert "`flowgrpo bench paths --steps 40`" in text and text.endswith("(sync-paths.png)\n")
    with pytest.raises(SystemExit):
        paths.main(["--replot"])
    assert "--replot needs --keep DIR" in capsys.readouterr().err
