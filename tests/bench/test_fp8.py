"""``flowgrpo bench fp8`` on the tiny model (fp32, CPU: PyTorch's reference FP8 kernel): the bf16
layers it swaps back in are the unquantized model exactly (the trainer's recompute under them
gives a trajectory's own log-probs, bitwise), the gap it reports is the one written out here
from the same trajectories, and the whole run's figures hold together."""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from flowgrpo.algorithms.objective import Forwards, Trajectory
from flowgrpo.models.bagel.config import tiny, tiny_vae
from flowgrpo.models.bagel.fp8 import quantize_gen_path
from flowgrpo.models.bagel.sampling import BagelSampler
from flowgrpo.sampler_params import SamplerParams
from flowgrpo.services.bench import fp8
from flowgrpo.services.bench.common import SPECIAL_TINY, make_requests, random_bagel, random_vae
from flowgrpo.services.bench.rollout_forward import Setup


def setup() -> Setup:
    cpu = torch.device("cpu")
    model, vae = random_bagel(tiny(), torch.float32, cpu), random_vae(tiny_vae(), torch.float32, cpu)
    return Setup(
        model=model, vae=vae, special=SPECIAL_TINY, device=cpu, prompt_len=6, num_points=5, repeats=3
    )


def trajectories(s: Setup, params: SamplerParams, count: int) -> list[Trajectory]:
    requests = make_requests(count, s.prompt_len, s.special)
    out = BagelSampler(s.model, s.vae, s.special).generate(requests, params, seed=1, step=0)
    return [Trajectory(r.prompt_uid, r.sample_index, 0, 0.0, r.prompt_ids, out.latents[i], out.log_probs[i],
                       out.sigmas[i]) for i, r in enumerate(requests)]  # fmt: skip


@torch.no_grad()
def test_the_swapped_back_layers_are_the_unquantized_model() -> None:
    s = setup()
    params = SamplerParams(num_points=5, height=32, width=32, window_size=4, window_range=(0, 4),
                           deterministic=True, decode_images=False)  # fmt: skip
    batch = trajectories(s, params, 3)  # drawn by the unquantized model
    originals = quantize_gen_path(s.model)
    forwards = Forwards(fp8.FrozenPolicy(s.model), s.special, fp8.OneRank(), micro_batch_size=8)
    with fp8.bf16_layers(s.model, originals):  # one sample a forward, as the deterministic sampler
        scored = torch.cat([forwards.window_log_probs([t], params).log_prob for t in batch])
    assert torch.equal(scored, torch.stack([t.log_probs for t in batch]))  # bitwise: the same function
    quantized = torch.cat([forwards.window_log_probs([t], params).log_prob for t in batch])  # FP8 again
    assert float((quantized - scored).abs().max()) > 0


@torch.no_grad()
def test_the_gap_is_the_fp8_samples_scored_under_the_unquantized_weights() -> None:
    s = setup()
    originals = quantize_gen_path(s.model)
    gap = fp8.logp_gap(s, originals, resolution=32, samples=4, noise_level=1.0, clips=[1e-5, 1e-3])
    params = SamplerParams(num_points=5, height=32, width=32, noise_level=1.0, window_size=4,
                           window_range=(0, 4), deterministic=False, decode_images=False)  # fmt: skip
    batch = trajectories(s, params, 4)  # the same requests and seed: the same FP8 trajectories
    forwards = Forwards(fp8.FrozenPolicy(s.model), s.special, fp8.OneRank(), micro_batch_size=8)
    with fp8.bf16_layers(s.model, originals):
        scored = forwards.window_log_probs(batch, params).log_prob
    expected = (scored.double() - torch.stack([t.log_probs for t in batch]).double()).abs()
    assert gap["all"]["max"] == float(expected.max()) > 0
    assert gap["per_step"]["max"] == expected.max(dim=0).values.tolist() and len(gap["per_step"]["p50"]) == 4
    for eps, share in gap["outside_clip"].items():
        assert share == float((expected > math.log1p(float(eps))).double().mean())


def test_the_whole_benchmark_on_the_tiny_model(tmp_path: Path) -> None:
    """``flowgrpo bench fp8`` as a user runs it, in a process of its own (its kernel profile
    starts torch.profiler, whose global state this test keeps out of the test process)."""
    out = tmp_path / "fp8.json"
    command = [sys.executable, "-m", "flowgrpo.services.cli", "bench", "fp8", "--model", "tiny", "--device",
               "cpu", "--dtype", "fp32", "--shapes", "64x4", "--num-points", "9", "--gap-samples", "4",
               "--fast-accum", "--json", str(out)]  # fmt: skip
    done = subprocess.run(
        command, capture_output=True, text=True, timeout=240, env=os.environ | {"OMP_NUM_THREADS": "1"}
    )
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-2000:]
    assert "64x4: FP8 / fp32 images/s" in done.stdout and "CFG forward" in done.stdout
    assert "with fast accumulation: FP8 / fp32 images/s" in done.stdout
    report = json.loads(out.read_text())
    assert (
        list(report["rows"]) == ["fp32", "fp8", "fp8_fast"] and report["fp8_fast_images_per_s_ratio"]["64x4"]
    )
    (dtype_row,), (fp8_row,) = report["rows"]["fp32"], report["rows"]["fp8"]
    assert dtype_row["step_tflop"] == fp8_row["step_tflop"] > 0  # the same FLOPs, counted once
    ratio = report["fp8_images_per_s_ratio"]["64x4"]["median"]
    assert math.isclose(
        ratio, fp8_row["images_per_s"]["median"] / dtype_row["images_per_s"]["median"], rel_tol=0.5
    )
    cfg = tiny()  # one byte a weight: q, k, v, o and the SwiGLU of every layer's gen expert
    q, kv = cfg.heads * cfg.head_dim, cfg.kv_heads * cfg.head_dim
    per_layer = cfg.hidden * (q + 2 * kv) + q * cfg.hidden + 3 * cfg.hidden * cfg.intermediate
    assert report["fp8_gen_path_gib"] * 2**30 == cfg.layers * per_layer
    for precision in ("fp32", "fp8"):  # the kernel profile of one CFG forward: every kind, shares of 1
        profile = report["kernels"][precision]["64x4"]
        assert profile["kinds"]["gemm"]["ms_per_call"] > 0 and profile["top"]
        assert sum(k["share"] for k in profile["kinds"].values()) == pytest.approx(1.0)
    assert any(k["name"] == "aten::_scaled_mm" for k in report["kernels"]["fp8"]["64x4"]["top"])
    gap, control = report["logp_gap"], report["logp_gap_bf16"]
    assert gap["samples"] == 4 and 0 < gap["all"]["mean"] <= gap["all"]["max"]
    assert control["samples"] == 4 and control["all"]["max"] < gap["all"]["mean"]  # not FP8's gap
    assert report["logp_gap_fast"] == gap  # the CPU's reference kernel has no fast accumulation


def test_the_kernel_profile_runs_without_autograd(monkeypatch: pytest.MonkeyPatch) -> None:
    """As the sampler does: a forward profiled with autograd on keeps every layer's activations
    for a backward that never comes (at 7B geometry that filled an H100's 80 GB)."""
    seen: list[bool] = []

    def record(fn: object, device: torch.device, calls: int = 3) -> dict[str, object]:
        seen.append(torch.is_grad_enabled())
        return {}

    monkeypatch.setattr(fp8, "kernel_profile", record)
    fp8.profile_step(setup(), 32, 2)
    assert seen == [False]
