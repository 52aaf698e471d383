"""``flowgrpo bench learning`` for one seed on a shortened demo: the trained run and its lr=0
control are paired (the same first step), and every figure of the row recomputes from the
stored per-step rewards. ``flowgrpo bench paths``: its page, and the refusal of --replot alone
(its runs are tested in tests/coordinator/test_train.py)."""

from __future__ import annotations

import json
import math
import os
import sys
from pathlib import Path

import pytest
from exactness import isa_report

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


# The README's demo shortened to 60 of its 120 steps, validated every 20. At step 60, seeds 0-2
# gained +21.9, +12.3, +20.2 points over their controls on an AMD EPYC (AVX2, this command's
# settings, 2026-12-07) and +14.0, +20.2, +24.6 on an Intel Xeon (AVX-512; docs/performance.md's
# runs at step 60): mean +18.9, seed-to-seed deviation 4.7. The bound is that mean less 2.5
# deviations: seed 0 (+21.9 / +14.0) clears it on both, and a run that learns nothing gains 0.
HELD_OUT = ["schedule.steps=60", "schedule.eval_every=20"]
MIN_HELD_OUT_GAIN = 7.0  # points


@pytest.mark.long
@pytest.mark.timeout(900)
def test_the_demo_learns_held_out_prompt_following_against_its_control(tmp_path: Path) -> None:
    """``flowgrpo bench learning --held-out`` on the prompt-following demo (DiffusionNFT on the
    compose task), seed 0: the held-out accuracy (114 test prompts, ODE, the same noise at every
    validation) of the trained run against its lr = 0 control, whose validations never move (the
    bench refuses a pair where they do), and the row recomputed from the validations."""
    out = tmp_path / "held-out.json"
    recipe = Path(__file__).resolve().parents[2] / "examples" / "tiny_demo.yaml"
    argv = ["--held-out", "--recipe", str(recipe), "--seeds", "0", "--threads", "1", "--jobs", "2",
            "--json", str(out), *HELD_OUT]  # fmt: skip
    assert learning.main(argv) == 0
    report = json.loads(out.read_text())
    [row] = report["rows"]
    trained = report["validations"]["seed0-native-t1-trained"]
    control = report["validations"]["seed0-native-t1-control"]
    assert len(trained) == 4 and len(control) == 3 and len(set(control)) == 1 and trained[0] == control[0]
    assert all(0 <= v <= 1 and round(v * 114, 6) == round(v * 114) for v in trained)  # a share of 114
    assert row["first"] == trained[0] and row["last"] == trained[-1] and row["control"] == control[0]
    assert row["gain_points"] == pytest.approx((trained[-1] - control[0]) * 100, abs=1e-9)
    assert row["best"] == max(trained)
    assert row["ahead"] == f"{sum(v > control[0] for v in trained[1:])}/3"
    assert row["gain_points"] >= MIN_HELD_OUT_GAIN, f"held-out {trained} against the control's {control[0]}"


def test_a_control_whose_validation_moved_is_refused() -> None:
    case = learning.Case(0, "", 1, control=False)
    with pytest.raises(SystemExit, match="must all equal the trained run's step 0"):
        learning.held_out_row(case, [0.5, 0.6], 1.0, [0.5, 0.5, 0.55], 1.0)
    with pytest.raises(SystemExit, match="must all equal the trained run's step 0"):
        learning.held_out_row(case, [0.4, 0.6], 1.0, [0.5, 0.5, 0.5], 1.0)


def test_the_paths_benchmark_page_and_its_options(capsys: pytest.CaptureFixture[str]) -> None:
    text = paths.page("| path | ... |", 40, "sync-paths.png")
    assert "`flowgrpo bench paths --steps 40`" in text and text.endswith("(sync-paths.png)\n")
    with pytest.raises(SystemExit):
        paths.main(["--replot"])
    assert "--replot needs --keep DIR" in capsys.readouterr().err


def test_an_instruction_set_caps_every_library_that_picks_its_own() -> None:
    """ATen's variable alone leaves MKL's GEMMs and oneDNN's convolutions on the CPU's best: avx2
    must name all three, the CPU's best none (whatever the caller's environment says)."""
    assert learning.isa_environment("avx2") == {
        "ATEN_CPU_CAPABILITY": "avx2",
        "ONEDNN_MAX_CPU_ISA": "AVX2",
        "MKL_ENABLE_INSTRUCTIONS": "AVX2",
    }
    assert learning.isa_environment("") == {}
    with pytest.raises(SystemExit, match="--isa 'avx3'"):
        learning.main(["--isa", "avx3", "--seeds", "0"])


def test_a_capped_case_runs_every_library_at_its_cap_and_a_native_one_at_the_cpus_best() -> None:
    """What a run of a capped row gets: a child started with the case's environment runs ATen and
    oneDNN at the cap (each says so; ``default``, below every CPU CI lands on, so the cap shows on
    each of them), whatever caps the caller had; a native case drops the caller's caps. (MKL says
    nothing of its kernels on an AMD CPU: tests/exactness.py.)"""
    caller = {**os.environ, "ATEN_CPU_CAPABILITY": "avx2", "ONEDNN_MAX_CPU_ISA": "AVX2"}
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(os, "environ", caller)
        capped = learning.case_environment(learning.Case(0, "default", 1, control=False))
        native = learning.case_environment(learning.Case(0, "", 2, control=True))
    assert capped["OMP_NUM_THREADS"] == "1" and native["OMP_NUM_THREADS"] == "2"
    assert isa_report(capped, sys.executable) == {"aten": "DEFAULT", "onednn": "Intel SSE4.1"}
    assert not set(learning.ISA_LIBRARIES) & set(native)
    plain = {k: v for k, v in os.environ.items() if k not in learning.ISA_LIBRARIES}
    assert isa_report(native, sys.executable) == isa_report(plain, sys.executable)
