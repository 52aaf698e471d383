"""``flowgrpo bench rollout``: its FLOP count and prompts (exact), and the whole benchmark on the
tiny model (fp32, CPU, the query path compiled with aot_eager): every code path runs, the fast
path agrees with the general one, and the figures hold together (images/s, MFU recompute from
the stored timings, FLOPs and peak; each run's loop fits inside the same run)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from flowgrpo.models.bagel.config import bagel_7b, tiny
from flowgrpo.services.bench import rollout
from flowgrpo.services.bench.common import SPECIAL_TINY, gen_matmul_params, make_requests, spec_step_flops
from flowgrpo.services.bench.rollout_forward import context_lengths

from .figures import check_figures, median


def test_spec_flop_count() -> None:
    """Exact parameter count; SPEC section 7's figures: 2.76e13 (512px) and 1.20e14 (1024px) per
    text-CFG step of one sample (two rows of empty context), 6.525e9 gen matmul parameters."""
    cfg = bagel_7b()
    assert gen_matmul_params(cfg) == 6_525_288_448
    assert spec_step_flops(cfg, 1024, [0, 0]) == pytest.approx(2.76e13, rel=2e-3)
    assert spec_step_flops(cfg, 4096, [0, 0]) == pytest.approx(1.20e14, rel=4e-3)
    extra = spec_step_flops(cfg, 1024, [48, 0]) - spec_step_flops(cfg, 1024, [0, 0])
    assert extra == 4 * 1026 * 48 * 128 * 28 * 28  # prompt keys only add attention FLOPs


def test_bench_requests_share_prompts_by_group() -> None:
    """Exact: 17 samples = 16 of prompt p0 and 1 of p1 (8 tokens longer), with the markers."""
    reqs = make_requests(17, 10, SPECIAL_TINY)
    assert [r.prompt_uid for r in reqs] == ["p0"] * 16 + ["p1"]
    assert reqs[0].prompt_ids.numel() == 10 and reqs[16].prompt_ids.numel() == 18
    assert reqs[0].prompt_ids[0] == SPECIAL_TINY.im_start and reqs[0].prompt_ids[-1] == SPECIAL_TINY.im_end
    assert context_lengths(reqs[15:]) == [10, 18, 0, 0]
    assert rollout.parse_shapes("512x8,1024X2") == [(512, 8), (1024, 2)] and rollout.parse_shapes("") == []


def test_the_rollout_benchmark_reports_consistent_figures(tmp_path: Path) -> None:
    out = tmp_path / "r.json"
    argv = ["--model", "tiny", "--device", "cpu", "--dtype", "fp32", "--shapes", "32x2", "--variants", "32x2",
            "--num-points", "8", "--compile-backend", "aot_eager", "--json", str(out),
            "--branch", "--branch-shape", "32x4", "--branch-begins", "0,3", "--cfg-free", "32x2"]  # fmt: skip
    assert rollout.main(argv) == 0
    report = json.loads(out.read_text())
    check_figures(report)
    peak = report["matmul_peak"]
    used = peak["used_tflops"] * 1e12
    assert peak["used_tflops"] == max(median(peak["before"]), median(peak["after"]))
    [row] = report["rows"]
    assert (row["resolution"], row["batch"], row["prompts"]) == (32, 2, 1)
    e2e, loop, step = row["end_to_end_s"], row["loop_s"], row["step_s"]
    assert e2e["n"] == loop["n"] == step["n"] == 3
    assert median(row["images_per_s"]) * median(e2e) == pytest.approx(row["batch"])
    assert all(inside < whole for inside, whole in zip(loop["values"], e2e["values"], strict=True))
    flops = row["step_tflop"] * 1e12
    # the FLOPs the MFU divides, from the shapes and not from the report: 2 samples of one
    # 48-token prompt (--prompt-len's default), each a conditional and an empty-context row, at
    # 32 px (4 latent tokens); spec_step_flops is pinned to SPEC's figures above
    assert flops == pytest.approx(spec_step_flops(tiny(), 4, [48, 48, 0, 0]), rel=1e-12)
    assert median(row["mfu_step"]) == pytest.approx(flops / median(step) / used)
    assert median(row["mfu_loop"]) == pytest.approx(7 * flops / median(loop) / used)  # 8 points: 7 steps
    variants = {v["variant"]: v for v in report["variants"]}
    assert set(variants) == {"general-eager", "query-eager", "query-compiled"}
    assert all(v["rel_diff"] < 1e-5 for v in variants.values())
    assert all(
        median(v["mfu"]) == pytest.approx(v["flops"] / median(v["step_s"]) / used) for v in variants.values()
    )
    assert report["once_s"]["first_compiled_forward"] > 0
    assert 0 < report["drift_tiny"]["rel_err"] < 0.05
    check_branching(report, used)
    check_guidance(report, used)


def check_guidance(report: dict[str, Any], peak: float) -> None:
    """--cfg-free 32x2: the same 2 samples of one prompt with text CFG 4 (a conditional and an
    empty-context row each, every step) and CFG-free (the conditional rows alone)."""
    guided, free = report["guidance"]
    assert (guided["cfg_text_scale"], free["cfg_text_scale"]) == (4.0, 1.0)
    assert guided["forward_rows"] == [4] * 7 and free["forward_rows"] == [2] * 7
    prompt = make_requests(2, 48, SPECIAL_TINY)[0].prompt_ids.numel()
    with_cfg = spec_step_flops(tiny(), 4, [prompt, prompt, 0, 0])
    conditional = spec_step_flops(tiny(), 4, [prompt, prompt])
    assert guided["tflop_per_image"] * 1e12 == pytest.approx(7 * with_cfg / 2, rel=1e-12)
    assert free["tflop_per_image"] * 1e12 == pytest.approx(7 * conditional / 2, rel=1e-12)
    for row in (guided, free):
        assert median(row["images_per_s"]) * median(row["end_to_end_s"]) == pytest.approx(2)
        assert median(row["mfu_loop"]) == pytest.approx(
            row["tflop_per_image"] * 2e12 / median(row["loop_s"]) / peak
        )
    gain = median(report["cfg_free_images_per_s_ratio"]["32x2"])
    assert gain == pytest.approx(median(free["images_per_s"]) / median(guided["images_per_s"]))


def check_branching(report: dict[str, Any], peak: float) -> None:
    """--branch: one group of 4 at 32 px (4 latent tokens), 7 steps, windows at 0 and 3: the rows
    through the model and the counted FLOPs are exactly the prefix-once formula's."""
    unbranched, at0, at3 = report["branching"]
    assert [(r["branch"], r["begin"], r["group"]) for r in report["branching"]] == [
        (False, 0, 4), (True, 0, 4), (True, 3, 4)]  # fmt: skip
    assert unbranched["forward_rows"] == at0["forward_rows"] == [8] * 7  # 4 samples x 2 CFG rows
    assert at3["forward_rows"] == [2] * 3 + [8] * 4  # the group's prefix: one sample's rows
    prompt = make_requests(4, 48, SPECIAL_TINY, group=4)[0].prompt_ids.numel()
    one, four = (spec_step_flops(tiny(), 4, [prompt] * n + [0] * n) for n in (1, 4))
    assert unbranched["tflop_per_image"] * 1e12 == pytest.approx(7 * four / 4, rel=1e-12)
    assert at3["tflop_per_image"] * 1e12 == pytest.approx((3 * one + 4 * four) / 4, rel=1e-12)
    assert at0["flops_fraction"] == 1.0 and at3["flops_fraction"] == pytest.approx(
        (3 * one + 4 * four) / (7 * four)
    )
    for row in report["branching"]:
        assert median(row["images_per_s"]) * median(row["end_to_end_s"]) == pytest.approx(4)
        assert median(row["mfu_loop"]) == pytest.approx(
            row["tflop_per_image"] * 4e12 / median(row["loop_s"]) / peak
        )
    for row in (at0, at3):
        ratio = median(report["branch_images_per_s_ratio"][f"begin {row['begin']}"])
        assert ratio == pytest.approx(median(row["images_per_s"]) / median(unbranched["images_per_s"]))
    expected = sum(b * one + (7 - b) * four for b in range(6)) / 6 / (7 * four)  # windows begin at 0-5
    assert report["branch_expected_flops_fraction"] == pytest.approx(expected)


def test_fewer_than_three_timed_runs_are_refused(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit):
        rollout.main(["--model", "tiny", "--device", "cpu", "--repeats", "1"])
    assert "every figure is a median of >= 3 runs" in capsys.readouterr().err
