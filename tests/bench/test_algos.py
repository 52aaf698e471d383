"""``flowgrpo bench algos`` on a shortened demo: every algorithm's runs are paired with their
controls, and every figure of a row recomputes from the stored curves."""

from __future__ import annotations

import json
import statistics
from pathlib import Path

import pytest

from flowgrpo.models.bagel.checkpoint import make_tiny_bagel
from flowgrpo.services.bench import algos

from .demo import SHORT_DEMO


@pytest.mark.timeout(900)
def test_the_algorithms_benchmark_pairs_and_recomputes(tmp_path: Path) -> None:
    model = make_tiny_bagel(tmp_path / "model", seed=0)
    out, figure = tmp_path / "algos.json", tmp_path / "algos.png"
    overrides = [f"model.checkpoint={model}", *SHORT_DEMO]  # first: --algorithms takes what follows it
    argv = [*overrides, "--seeds", "0", "--steps", "4", "--threads", "1", "--jobs", "2", "--json", str(out),
            "--plot", str(figure), "--algorithms", *algos.ALGORITHMS]  # fmt: skip
    assert algos.main(argv) == 0
    report = json.loads(out.read_text())
    assert [r["algorithm"] for r in report["rows"]] == list(algos.ALGORITHMS)
    assert figure.stat().st_size > 10_000
    for row, curve in zip(report["rows"], report["curves"], strict=True):
        assert curve["gain"][0] == 0.0  # step 1 precedes any update: the pair agrees there
        assert curve["images"] == [4.0, 8.0, 12.0, 16.0]  # one prompt of 4 samples per step
        final = statistics.fmean(curve["gain"][-2:])
        assert row["final_gain"]["median"] == pytest.approx(final)
        assert row["gain_per_kimage"]["median"] == pytest.approx(final / 16 * 1000)
        assert row["gain_per_trainer_s"]["median"] == pytest.approx(final / curve["trainer_s"][-1])
        assert all(b > a for a, b in zip(curve["trainer_s"], curve["trainer_s"][1:], strict=False))
