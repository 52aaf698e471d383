"""``flowgrpo bench consistency`` on the tiny model (CPU, fp32): the batch-invariant mode's
rollout/trainer gap is 0 at every window step, before and after a published LoRA update, and the
plain batched mode's is not; every timed figure is a median of >= 3 runs."""

from __future__ import annotations

import json
from pathlib import Path

from flowgrpo.services.bench import consistency

from .figures import check_figures


def test_batch_invariance_closes_the_gap_that_batching_opens(tmp_path: Path) -> None:
    out = tmp_path / "consistency.json"
    assert consistency.main(["--json", str(out)]) == 0
    report = json.loads(out.read_text())
    check_figures(report)
    invariant, plain = report["modes"]["invariant"], report["modes"]["plain"]
    for key in ("gap_per_window_step", "gap_per_window_step_after_update"):
        assert len(invariant[key]) == 2 and all(g == 0.0 for g in invariant[key]), key
    assert max(plain["gap_per_window_step"] + plain["gap_per_window_step_after_update"]) > 0
