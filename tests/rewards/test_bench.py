"""``flowgrpo bench reward`` runs every scorer and reports images per second (tiny sizes here)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from flowgrpo.services.bench import reward


def test_bench_reports_images_per_second_for_every_scorer(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    out = tmp_path / "rows.json"
    argv = ["--images", "2", "--size", "64", "--batch-size", "2", "--repeats", "3", "--json", str(out)]
    assert reward.main(argv) == 0
    rows = json.loads(out.read_text())
    names = [row["scorer"] for row in rows]
    assert names == ["jpeg_compressibility", "plugin", "ocr_offline", "judge",
                     "pickscore[tiny,cpu,float32]", "pickscore_model[tiny,cpu,float32]"]  # fmt: skip
    for row in rows:  # every image, batches of 2; the rate is the images over the median time
        assert (row["images"], row["batch"]) == (2, 2) and row["images_per_s"]["n"] == 3, row
        assert row["images_per_s"]["median"] == pytest.approx(2 / row["seconds"]["median"], rel=1e-12), row
    assert "images/s" in capsys.readouterr().out


def test_unknown_scorers_are_refused(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit):
        reward.main(["--scorers", "jpeg_compressibility,aesthetic"])
    assert "unknown scorer(s) aesthetic" in capsys.readouterr().err
