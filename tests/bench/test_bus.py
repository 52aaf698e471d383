"""``flowgrpo bench bus`` at one small size: every path and round trip is measured, and the GB/s,
the ratios to memcpy and the CURVE-over-plain ratios recompute from the stored timings."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from flowgrpo.services.bench import bus

from .figures import check_figures, median

PATHS = ["memcpy", "ipc", "tcp", "shm", "shm-view", "ipc+curve", "tcp+curve"]


def test_the_bus_benchmark_reports_consistent_figures(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    out = tmp_path / "bus.json"
    assert bus.main(["--sizes-mib", "1", "--repeats", "3", "--latency-n", "30", "--json", str(out)]) == 0
    report = json.loads(out.read_text())
    check_figures(report)
    rows = {r["path"]: r for r in report["throughput"]}
    assert list(rows) == PATHS
    memcpy = median(rows["memcpy"]["seconds"])
    for row in rows.values():
        assert row["seconds"]["n"] == 3
        assert median(row["gb_s"]) * median(row["seconds"]) == pytest.approx(bus.MiB / 1e9)
        assert median(row["ratio"]) == pytest.approx(memcpy / median(row["seconds"]))
    curve = report["curve_over_plain"]
    for transport in ("ipc", "tcp"):
        plain_s, curve_s = median(rows[transport]["seconds"]), median(rows[f"{transport}+curve"]["seconds"])
        assert median(curve[transport]["1 MiB"]) == pytest.approx(plain_s / curve_s)
    trips = {(lat["transport"], lat["message"]): lat for lat in report["latency"]}
    assert len(trips) == 10  # PING and FETCH on four producers, the bare echo on the two plain ones
    for lat in trips.values():
        figure = lat["round_trip_us"]
        assert figure["n"] == 30 and figure["median"] <= lat["p99_us"] <= figure["max"]
    ping = median(trips["ipc+curve", "PING"]["round_trip_us"]) / median(trips["ipc", "PING"]["round_trip_us"])
    assert median(curve["ipc"]["PING p50"]) == pytest.approx(ping)
    assert "median (min-max) of 3 fetches after a warm-up" in capsys.readouterr().out
