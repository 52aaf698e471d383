"""``flowgrpo bench learning`` for one seed on a shortened demo: the trained run and its lr=0
control are paired (the same first step), and every figure of the row recomputes from the
stored per-step rewards. ``flowgrpo bench paths``: its page, and the refusal of --replot alone
(its runs are tested in tests/coordinator/test_train.py)."""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
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


def test_held_out_pairs_the_demo_with_a_control_whose_validation_never_moves(tmp_path: Path) -> None:
    """``--held-out`` on the prompt-following demo, shortened: the control's three validations
    are one value, the trained run's step 0 equals it, and the row recomputes from them."""
    out = tmp_path / "held-out.json"
    recipe = Path(__file__).resolve().parents[2] / "examples" / "tiny_demo.yaml"
    short = ["schedule.steps=2", "schedule.eval_every=1", "data.prompts_per_step=4", "data.group_size=4",
             "data.val_prompts=16", "trainer.loss.micro_batch_size=16", "trainer.optim.lr=3e-3"]  # fmt: skip
    argv = ["--held-out", "--recipe", str(recipe), "--seeds", "0", "--threads", "1", "--jobs", "2",
            "--json", str(out), *short]  # fmt: skip
    assert learning.main(argv) == 0
    report = json.loads(out.read_text())
    [row] = report["rows"]
    trained = report["validations"]["seed0-native-t1-trained"]
    control = report["validations"]["seed0-native-t1-control"]
    assert len(trained) == len(control) == 3 and len(set(control)) == 1 and trained[0] == control[0]
    assert all(0 <= v <= 1 and v * 16 == round(v * 16) for v in trained)  # a share of 16 prompts
    assert row["first"] == trained[0] and row["last"] == trained[-1] and row["control"] == control[0]
    assert row["gain_points"] == pytest.approx((trained[-1] - control[0]) * 100, abs=1e-9)
    assert row["best"] == max(trained)
    assert row["ahead"] == f"{sum(v > control[0] for v in trained[1:])}/2"
    assert set(row["once_s"]) == {"trained_run", "control_run"}


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


def test_capping_mkl_and_onednn_changes_the_arithmetic() -> None:
    """What the avx2 rows are for: a matrix product and a convolution computed under the caps
    differ in their bits from the CPU's best where that best is AVX-512 (else they are the same
    code path, and nothing here is distinct to check)."""
    code = (
        "import torch, hashlib; torch.manual_seed(0); torch.set_num_threads(1); "
        "a, b = torch.randn(300, 257), torch.randn(257, 129); "
        "c = torch.nn.functional.conv2d(torch.randn(2, 64, 16, 16), torch.randn(64, 64, 3, 3), padding=1); "
        "print(torch.backends.cpu.get_cpu_capability(), hashlib.md5((a @ b).numpy().tobytes()).hexdigest(), "
        "hashlib.md5(c.numpy().tobytes()).hexdigest())"
    )
    plain = {k: v for k, v in os.environ.items() if k not in learning.ISA_LIBRARIES}

    def run(env: dict[str, str]) -> list[str]:
        done = subprocess.run(
            [sys.executable, "-c", code], env=env, capture_output=True, text=True, check=True
        )
        return done.stdout.split()

    best, capped = run(plain), run({**plain, **learning.isa_environment("avx2")})
    assert capped[0] == "AVX2"
    if best[0] != "AVX512":
        pytest.skip(f"this CPU's best is {best[0]}: avx2 is not another code path here")
    assert capped[1] != best[1] and capped[2] != best[2]
