"""``flowgrpo bench scale`` at 20 simulated rollouts (2 host processes, 4 reward replicas, the real
coordinator and trainer), 2 of them SIGKILLed during step 2 (one while generating, one while the
new weights load): every step trains on every group, the coordinator declares both lost, every
survivor reports the last policy version in its heartbeats; the figures are there and consistent."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

from flowgrpo.services.bench import scale


def test_the_scale_benchmark_survives_replicas_killed_mid_step_and_reports_its_figures(
    tmp_path: Path,
) -> None:
    out = tmp_path / "scale.json"
    argv = ["--replicas", "20", "--per-host", "9", "--rewards-per-host", "2", "--rollouts-per-reward", "5",
            "--steps", "3", "--kill-fraction", "0.1", "--heartbeat-interval-s", "0.5", "--lost-after-s", "3",
            "--work-dir", str(tmp_path / "work"), "--json", str(out)]  # fmt: skip
    assert scale.main(argv) == 0  # 1 when the failure was not survived
    (point,) = json.loads(out.read_text())["points"]
    kill = point["kill"]
    assert kill["killed"] == 2 and kill["declared_lost"] == 2
    assert kill["survivors"] == 18 == kill["survivors_on_last_version"] and kill["last_version"] == 3
    assert kill["dropped_groups"] == 0 and kill["samples_trained"] == [40, 40, 40]
    assert point["retries"] >= 2  # both kills landed on calls in flight (or the next ones)
    assert (point["rollouts"], point["rewards"]) == (20, 4)
    # each figure against what bounds it, not merely > 0 (which any live run satisfies)
    assert 0 < point["coordinator_cpu_s"] <= point["step_wall_s"] * (os.cpu_count() or 1)
    # 25 members beating every 0.5 s: 50/s told; 2 of them killed mid-run, beats late under load
    assert point["heartbeats_expected_per_s"] == pytest.approx(25 / point["heartbeat_interval_s"])
    assert 0.3 * point["heartbeats_expected_per_s"] <= point["heartbeats_per_s"]
    assert point["heartbeats_per_s"] <= 1.2 * point["heartbeats_expected_per_s"]
    assert point["samples_ideal"] == 2 and point["samples_min"] <= 2 <= point["samples_max"]
    assert 0 < point["publication_time_to_all_s"] < point["step_wall_s"]  # a part of each step
    assert point["publication_trainer_bytes_sent"] > 0
    assert point["fds"] >= 25  # a gRPC connection to each of the 25 replicas at least
    assert 30 < point["rss_mib"] < 2048
