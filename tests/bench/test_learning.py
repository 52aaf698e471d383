"""``flowgrpo bench learning`` for one seed on a shortened demo: the trained run and its lr=0
control are paired (the same first step), and every figure of the row recomputes from the
stored per-step rewards. ``flowgrpo bench paths``: its page, and the refusal of --replot alone
(its runs are tested in tests/coordinator/test_train.py)."""

from __future__ import annotations

import json
import math
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
    # the update moved the policy: from step 2 on the trained run samples other images than its
    # lr=0 control, whose weights never change
    assert all(t != c for t, c in zip(trained[1:], control[1:], strict=True)), (trained, control)
    # the figures, written out by hand for 4 steps (a quarter is max(4 // 4, 2) = 2 steps)
    t0, t1, t2, t3 = trained
    c0, c1, c2, c3 = control
    mean_c = (c0 + c1 + c2 + c3) / 4
    spread = math.sqrt(sum((c - mean_c) ** 2 for c in (c0, c1, c2, c3)) / 3)  # the sample deviation
    gain = ((t2 - c2) + (t3 - c3)) / 2
    assert row["first_quarter"] == pytest.approx((t0 + t1) / 2, rel=1e-12)
    assert row["last_quarter"] == pytest.approx((t2 + t3) / 2, rel=1e-12)
    assert row["control_last_quarter"] == pytest.approx((c2 + c3) / 2, rel=1e-12)
    assert row["gain"] == pytest.approx(gain, rel=1e-12, abs=1e-15)
    assert row["control_spread"] == pytest.approx(spread, rel=1e-12)
    assert row["gain_over_spread"] == pytest.approx(gain / spread, rel=1e-12, abs=1e-15)
    assert row["ahead"] == f"{sum(t > c for t, c in [(t1, c1), (t2, c2), (t3, c3)])}/3"
    assert row["digest"] == learning.digest(trained) != learning.digest(control)
    assert set(row["once_s"]) == {"trained_run", "control_run"}


def test_the_paths_benchmark_page_and_its_options(capsys: pytest.CaptureFixture[str]) -> None:
    text = paths.page("| path | ... |", 40, "sync-paths.png")
    assert "`flowgrpo bench paths --steps 40`" in text and text.endswith("(sync-paths.png)\n")
    with pytest.raises(SystemExit):
        paths.main(["--replot"])
    assert "--replot needs --keep DIR" in capsys.readouterr().err
