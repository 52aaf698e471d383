"""``flowgrpo bench system`` on a shortened demo (4 steps, 4 samples, in one process), two variants
in one call: every figure is over the 3 steps after the warm-up; the FLOPs per image equal the
SPEC-7 formulas worked out here; the limit, achieved / limit and the MFUs recompute from the
stored FLOPs, peak and per-step metrics; each step's parts plus idle are its wall time."""

from __future__ import annotations

import argparse
import json
import statistics
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from flowgrpo.configs.run import load_run_config
from flowgrpo.data import load_split
from flowgrpo.models.bagel.checkpoint import make_tiny_bagel, read_bagel_config
from flowgrpo.models.bagel.config import bagel_7b
from flowgrpo.services.bench import system
from flowgrpo.services.bench.common import spec_step_flops
from flowgrpo.services.bench.trainer_flops import pass_flops, row_flops

from .demo import SHORT_DEMO
from .figures import check_figures, median

EXAMPLES = Path(__file__).resolve().parents[2] / "examples"
GROUP, POINTS, WINDOW, LATENT_TOKENS = 4, 4, 2, (64 // 16) ** 2  # SHORT_DEMO and the demo's 64 px


def expected_step_flops(model: Path, length: int) -> dict[str, float]:
    """One step of the shortened demo (one prompt of ``length`` tokens, G = 4, CFG on, full
    gen-path training, one mini-batch), from the formulas: (num_points - 1) denoising steps of G
    conditional and G empty-context rows, and the training pass over the window; no logp_old
    recompute (one mini-batch: its forwards give every row's)."""
    cfg = read_bagel_config(model)
    rollout = (POINTS - 1) * spec_step_flops(cfg, LATENT_TOKENS, [length] * GROUP + [0] * GROUP)
    train = pass_flops(cfg, LATENT_TOKENS, [length] * GROUP, WINDOW, kind="full", rank=0, targets=[])
    return {"rollout": rollout, "logp_old": 0.0, "update": train["update"]}


def check_variant(r: dict[str, Any], model: Path, prompt_lengths: list[int], peak_tflops: float) -> None:
    steady = r["steps"][1:]
    assert len(r["steps"]) == 4 and len(steady) == 3 == r["images_per_s"]["n"]
    for step, drawn in zip(r["flops_per_step"], prompt_lengths, strict=True):  # each step's own prompt
        (length,) = step["prompt_lengths"]
        assert length == drawn, step["step"]
        expected = expected_step_flops(model, length)
        assert {k: step[k] for k in expected} == pytest.approx(expected, rel=1e-12)
        assert step["reference"] == 0.0 and step["logp_old_recomputed"]
    flops = r["flops_per_step"][1:]
    fpi = r["flops_per_image"]
    for part in ("rollout", "logp_old", "update"):
        assert fpi[part] == pytest.approx(sum(f[part] for f in flops) / (GROUP * 3), rel=1e-12)
    assert fpi["total"] == pytest.approx(fpi["rollout"] + fpi["logp_old"] + fpi["update"], rel=1e-12)
    limit = peak_tflops * 1e12 / fpi["total"]
    assert median(r["limit_images_per_s"]) == pytest.approx(limit, rel=1e-12)
    rates = [m["trainer/samples"] / m["timing_s/step"] for m in steady]
    assert median(r["images_per_s"]) == pytest.approx(statistics.median(rates))
    assert median(r["achieved_over_limit"]) == pytest.approx(statistics.median(rates) / limit)
    assert r["mfu"]["end_to_end"] == r["achieved_over_limit"]
    check_split(r, steady)
    gen = [m["timing_s/gen"] for m in steady]
    rollout_mfu = [f["rollout"] / s / (peak_tflops * 1e12) for f, s in zip(flops, gen, strict=True)]
    assert median(r["mfu"]["rollout"]) == pytest.approx(statistics.median(rollout_mfu))
    assert r["gpu_memory_gib"] == "no nvidia-smi: not measured"


def check_split(r: dict[str, Any], steady: list[dict[str, float]]) -> None:
    for split, m in zip(r["split_per_step"], steady, strict=True):
        assert split["step"] == m["timing_s/step"]
        parts = [split[p] for p in system.SPLIT]
        assert sum(parts) + split["idle"] == pytest.approx(split["step"], rel=1e-12)
        assert split["rollout"] == m["timing_s/gen"] and split["logp_old"] == m["timing_s/old_log_prob"]
        assert split["publication"] == m["timing_s/update_weights"] + m["timing_s/load_weights"]
        assert all(split[p] > 0 for p in system.SPLIT)
    for part, figure in r["split_s"].items():
        assert median(figure) == pytest.approx(statistics.median(s[part] for s in r["split_per_step"]))
        if part != "step":
            assert median(r["share_of_step"][part]) == pytest.approx(
                median(figure) / median(r["split_s"]["step"])
            )


def test_the_system_benchmark_reports_consistent_figures(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.setattr(system, "NVIDIA_SMI", "no-nvidia-smi-here")  # no GPU memory, even beside a GPU
    model = make_tiny_bagel(tmp_path / "model", seed=0)
    out = tmp_path / "system.json"
    options = ["--steps", "4", "--launcher", "inprocess", "--device", "cpu", "--json", str(out)]
    variants = ["--variant", "base", "--variant", "lr0:trainer.optim.lr=0"]
    keep = ["--keep", str(tmp_path / "runs")]
    assert system.main([*options, *variants, *keep, f"model.checkpoint={model}", *SHORT_DEMO]) == 0
    printed = capsys.readouterr().out
    assert "no nvidia-smi: not measured" in printed and "VAE decode" in printed
    report = json.loads(out.read_text())
    check_figures(report)
    assert set(report["variants"]) == {"base", "lr0"}
    assert report["variants"]["lr0"]["overrides"] == ["trainer.optim.lr=0"]
    peak = report["peak"]["used_tflops"]
    assert peak == max(median(report["peak"]["before"]), median(report["peak"]["after"]))
    split = load_split(tmp_path / "runs" / "base" / "data", "train")
    # the coordinator's order (run seed 0, epoch 0: one numpy permutation), one prompt per step
    order = np.random.default_rng([0, 0]).permutation(len(split))
    drawn = [int(split[int(order[s])].prompt_ids.size) for s in range(4)]
    assert len(set(drawn)) > 1, "prompts of different lengths: a wrong step-to-prompt mapping shows"
    for r in report["variants"].values():
        check_variant(r, model, drawn, peak)


def test_a_variant_keeps_the_commas_inside_a_value() -> None:
    variant = system.variant_arg("narrow:sampling.window_range=[0,2],trainer.optim.lr=0")
    assert variant == system.Variant("narrow", ("sampling.window_range=[0,2]", "trainer.optim.lr=0"))
    assert system.variant_arg("plain") == system.Variant("plain", ())
    with pytest.raises(argparse.ArgumentTypeError):
        system.variant_arg("bad:no-equals-sign")


def test_flowgrpo_recomputes_logp_old_for_the_rows_after_the_first_mini_batch() -> None:
    """The one-GPU recipe (2 mini-batches): the first mini-batch's rows take logp_old from their
    own forwards, so the recompute's FLOPs are the second mini-batch's rows' (the second prompt's
    group), written out per row; none where logp_old was bypassed."""
    paths = ["model.checkpoint=/ckpt/m", "data.dataset=/data/pickscore"]  # never read
    cfg = load_run_config(EXAMPLES / "bagel_pickscore_lora_1gpu.yaml", [*paths, "data.prompts_per_step=2"])
    assert cfg.trainer.loss.mini_batches == 2
    work = system.Workload(bagel_7b(), cfg.sampling.params(), cfg)
    policy, group = cfg.trainer.policy, cfg.data.group_size
    lengths = [12] * group + [30] * group
    rows = [
        row_flops(
            work.model, work.latent_tokens, n, kind="lora", rank=policy.lora_rank, targets=policy.lora_targets
        )
        for n in (30, 0)  # the second prompt's conditional row and its empty-context (CFG) row
    ]
    flops = system.training_flops(work, lengths, recomputed=True)
    window = cfg.sampling.params().window_size
    assert flops["logp_old"] == pytest.approx(group * window * sum(f.forward for f in rows), rel=1e-12)
    assert system.training_flops(work, lengths, recomputed=False)["logp_old"] == 0.0


@pytest.mark.parametrize(
    ("overrides", "old_passes", "base_rows"),
    [
        ([], 2, 1),  # the recipe's clip (1e-2) needs the old policy; its conditional base: reference and KL
        (["trainer.algorithm.clip_range=.inf"], 1, 1),
        (["trainer.algorithm.reference_cfg=4", "trainer.loss.kl_beta=1e-3"], 2, 2),  # the CFG-free mode
        (
            [
                "trainer.algorithm.reference=old",
                "trainer.algorithm.clip_range=.inf",
                "trainer.loss.kl_beta=0",
            ],
            2,
            0,
        ),
    ],
)
def test_dgpo_s_trainer_flops_are_its_passes_written_out(
    overrides: list[str], old_passes: int, base_rows: int
) -> None:
    """Per trajectory and trained time K: the current policy's conditional forward without
    gradients, the old policy's where the clip or the DPO reference needs it, the frozen base's
    (with its empty-context row at reference CFG > 1) where the reference or the KL needs it, and
    the conditional forward-backward; the LoRA policy's rows carry its adapters, the base's none."""
    paths = ["model.checkpoint=/ckpt/m", "data.dataset=/data/pickscore"]  # never read
    cfg = load_run_config(EXAMPLES / "bagel_pickscore_lora_dgpo.yaml", [*paths, *overrides])
    work = system.Workload(bagel_7b(), cfg.sampling.params(), cfg)
    policy, times, lengths = cfg.trainer.policy, 4, [12, 30]
    tokens = work.latent_tokens
    mine = [row_flops(work.model, tokens, n, kind="lora", rank=policy.lora_rank, targets=policy.lora_targets)
            for n in lengths]  # fmt: skip
    base = [row_flops(work.model, tokens, n, kind="lora", rank=0, targets=[]) for n in [*lengths, 0]]
    expected = {
        "logp_old": old_passes * times * sum(f.forward for f in mine),
        "reference": times
        * (sum(f.forward for f in base[:2]) + (base_rows == 2) * len(lengths) * base[2].forward)
        if base_rows
        else 0.0,
        "update": times * sum(f.forward + f.act_grad + f.weight_grad for f in mine),
    }
    assert system.training_flops(work, lengths, recomputed=True) == pytest.approx(expected, rel=1e-12)
