"""``flowgrpo bench relay`` at N = 4 in its own namespaces: the trainer's own count says the star
sent N copies and the relay k, and the ratios and formulas recompute from the stored figures."""

from __future__ import annotations

import json
import shutil
import subprocess
from pathlib import Path

import pytest

from flowgrpo.services.bench import relay

from .figures import check_figures, median


def _namespaces_work() -> bool:
    unshare = shutil.which("unshare")
    return (
        unshare is not None and subprocess.run([unshare, "-rn", "true"], capture_output=True).returncode == 0
    )


@pytest.mark.skipif(not _namespaces_work(), reason="needs unprivileged user and network namespaces")
def test_the_relay_benchmark_counts_the_trainers_copies_and_recomputes(tmp_path: Path) -> None:
    out, page = tmp_path / "relay.json", tmp_path / "relay.md"
    args = ["--replicas", "4", "--fanouts", "2", "--payloads", "lora", "--scale", "100",
            "--rate-mbit", "100", "--repeats", "3", "--json", str(out), "--markdown", str(page)]  # fmt: skip
    assert relay.main(args) == 0
    report = json.loads(out.read_text())
    check_figures(report)
    rows = {r["mode"]: r for r in report["rows"]}
    assert list(rows) == ["star", "relay k=2"]
    nbytes = rows["star"]["bytes"]
    assert rows["star"]["trainer_bytes_sent"]["max"] == 4 * nbytes  # the trainer's store counted it
    assert rows["relay k=2"]["trainer_bytes_sent"]["max"] == 2 * nbytes
    assert (rows["star"]["depth"], rows["relay k=2"]["depth"]) == (1, 2)
    star_s, relay_s = median(rows["star"]["time_to_all_s"]), median(rows["relay k=2"]["time_to_all_s"])
    assert median(rows["relay k=2"]["star_over_this"]) == pytest.approx(star_s / relay_s)
    bytes_per_s = 100e6 / 8
    assert rows["star"]["formula_time"] == pytest.approx(4 * nbytes / bytes_per_s)
    assert rows["relay k=2"]["formula_time"] == pytest.approx(2 * 2 * nbytes / bytes_per_s)
    assert all(r["failed_replicas"] == 0 for r in rows.values())
    assert "| lora" in page.read_text() and "formula only (not measured)" in page.read_text()
