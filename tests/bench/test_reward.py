"""``flowgrpo bench reward`` on the quick scorers (tests/rewards/test_bench.py runs them all):
each row's images/s recomputes from its timing; the load is a one-off apart from the figures."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from flowgrpo.services.bench import reward

from .figures import check_figures, median


def test_the_reward_benchmark_reports_consistent_figures(tmp_path: Path) -> None:
    out = tmp_path / "rows.json"
    argv = ["--scorers", "jpeg_compressibility,plugin,pickscore", "--images", "4", "--size", "64",
            "--batch-size", "2", "--json", str(out)]  # fmt: skip
    assert reward.main(argv) == 0
    rows = json.loads(out.read_text())
    check_figures(rows)
    names = [row["scorer"] for row in rows]
    assert names == ["jpeg_compressibility", "plugin", "pickscore[tiny,cpu,float32]",
                     "pickscore_model[tiny,cpu,float32]"]  # fmt: skip
    for row in rows:
        assert row["seconds"]["n"] == 3
        assert median(row["images_per_s"]) * median(row["seconds"]) == pytest.approx(row["images"])
    # the load is timed around building the scorer, apart from the scoring: building a CLIP model
    # takes far longer than the JPEG scorer, which builds nothing (the control); the model-only
    # row times the pickscore row's scorer, built once
    load = {row["scorer"]: row["once_s"]["load"] for row in rows}
    assert load.pop("pickscore_model[tiny,cpu,float32]") == 0.0
    assert all(seconds > 0 for seconds in load.values()), load
    assert load["pickscore[tiny,cpu,float32]"] > 10 * load["jpeg_compressibility"], load


def test_fewer_than_three_timed_runs_are_refused(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit):
        reward.main(["--repeats", "2"])
    assert "every figure is a median of >= 3 runs" in capsys.readouterr().err
