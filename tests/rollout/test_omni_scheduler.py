"""The vLLM-Omni engine's torch-only parts, without vLLM-Omni: the request that rides in
``extra_args`` and the scheduler hook, driven here by the native model's velocities exactly as
vLLM-Omni's BAGEL loop drives it, against the native sampler (fp32: bitwise)."""

from __future__ import annotations

import importlib.util
from dataclasses import replace
from pathlib import Path

import msgpack
import pytest
import torch

from flowgrpo.fields import FieldError
from flowgrpo.models.bagel.checkpoint import load_bagel_model, load_special_tokens, make_tiny_bagel
from flowgrpo.models.bagel.model import latent_position_ids
from flowgrpo.models.bagel.sampling import (
    BagelSampler,
    SampleRequest,
    deterministic_kernels,
    guided_velocity,
    prefill_prompts,
    with_cfg_branches,
)
from flowgrpo.sampler_math import sample_noise, shifted_schedule, window_begin
from flowgrpo.sampler_params import SamplerParams
from flowgrpo.services.rollout.omni.request import EXTRA_ARGS_KEY, OmniSampleRequest
from flowgrpo.services.rollout.omni.scheduler import FlowGrpoScheduler

PARAMS = SamplerParams(
    num_points=7,
    height=32,
    width=48,
    cfg_text_scale=2.5,
    noise_level=1.2,
    window_size=2,
    window_range=(0, 5),
    deterministic=True,
    decode_images=False,
)
IDS = [384, 5, 6, 7, 385]


def omni_request(
    params: SamplerParams, uid: str = "p0", index: int = 2, seed: int = 9, step: int = 4
) -> OmniSampleRequest:
    return OmniSampleRequest(
        prompt_ids=tuple(IDS),
        prompt_uid=uid,
        sample_index=index,
        seed=seed,
        step=step,
        window_begin=window_begin(params, seed, step, uid),
        params=params.to_proto().SerializeToString(),
    )


def test_request_survives_extra_args_and_a_wire_round_trip() -> None:
    """Plain values only (what vLLM-Omni may serialise between its processes), BAGEL's own CFG
    knobs beside ours, and the sampler settings decoded with their range checks."""
    request = omni_request(PARAMS)
    extra = request.extra_args()
    wire = msgpack.unpackb(msgpack.packb(extra), strict_map_key=False)
    assert OmniSampleRequest.from_extra_args(wire) == request
    assert request.sampler_params == PARAMS
    assert extra["cfg_text_scale"] == 2.5 and extra["timestep_shift"] == PARAMS.timestep_shift
    assert extra["cfg_interval"] == [0.0, 1.0] and extra["negative_prompt"] == ""
    assert OmniSampleRequest.from_extra_args({"cfg_text_scale": 4.0}) is None
    assert OmniSampleRequest.from_extra_args(None) is None
    wire[EXTRA_ARGS_KEY]["params"] = replace(PARAMS, noise_level=99.0).to_proto().SerializeToString()
    hostile = OmniSampleRequest.from_extra_args(wire)
    assert hostile is not None
    with pytest.raises(FieldError, match="noise_level"):
        _ = hostile.sampler_params


@pytest.fixture(scope="module")
def tiny(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_tiny_bagel(tmp_path_factory.mktemp("tiny"), seed=0)


@pytest.mark.bitwise
@pytest.mark.parametrize("sde_type", ["sde", "cps"])
def test_scheduler_reproduces_the_native_sampler_bitwise(tiny: Path, sde_type: str) -> None:
    """vLLM-Omni's loop: the initial noise in, then per step the CFG-combined velocity of x_t at
    vLLM-Omni's t, the scheduler's x_{t+1} back in. With the native velocities, every latent and
    window log-prob equals the native sampler's."""
    params = replace(PARAMS, sde_type=sde_type, noise_level=0.8 if sde_type == "cps" else 1.2)
    request = omni_request(params)
    model, special = load_bagel_model(tiny, torch.float32), load_special_tokens(tiny)
    native = BagelSampler(model, None, special).generate(
        [SampleRequest(request.prompt_uid, request.sample_index, torch.tensor(IDS))],
        params,
        seed=request.seed,
        step=request.step,
    )
    scheduler = FlowGrpoScheduler(request)
    omni_t = torch.linspace(1, 0, params.num_points)  # vLLM-Omni's fp32 schedule, computed its way
    omni_t = params.timestep_shift * omni_t / (1 + (params.timestep_shift - 1) * omni_t)
    # the native sampler's deterministic mode: the same kernels on ONE thread (a matmul split over
    # two threads rounds otherwise where the BLAS path splits its reductions, e.g. MKL on AVX2 CPUs)
    with torch.no_grad(), deterministic_kernels():
        context = with_cfg_branches(model, prefill_prompts(model, [torch.tensor(IDS)]), params)
    pos_ids = latent_position_ids(2, 3, model.config.max_latent_size, "cpu")
    x = sample_noise(
        (6, 64),
        seed=request.seed,
        step=request.step,
        prompt_uid=request.prompt_uid,
        sample_index=request.sample_index,
        stream="init",
    )
    latents, log_probs = [x], []
    schedule = shifted_schedule(params.num_points, params.timestep_shift)
    with torch.no_grad(), deterministic_kernels():
        for i in range(params.num_steps):
            v = guided_velocity(
                model, context, x[None], schedule[i : i + 1], pos_ids, params=params, special=special
            )
            out = scheduler.step(v[0], omni_t[i], x, omni_t[i] - omni_t[i + 1])
            x = out.prev_sample
            latents.append(x)
            if out.log_prob is not None:
                log_probs.append(out.log_prob)
    begin = request.window_begin
    assert int(native.window_begin[0]) == begin
    assert torch.equal(torch.stack(latents[begin : begin + params.window_size + 1]), native.latents[0])
    assert torch.equal(torch.stack(log_probs), native.log_probs[0])
    assert torch.equal(x, native.final_latents[0])


def test_scheduler_refuses_a_foreign_schedule_and_extra_steps() -> None:
    """A vLLM-Omni whose timesteps are not this schedule's (another shift or point count) or that
    steps past it fails loudly instead of sampling something the trainer would score otherwise."""
    request = omni_request(PARAMS)
    x, v = torch.zeros(6, 64), torch.zeros(6, 64)
    with pytest.raises(RuntimeError, match="is not this schedule's"):
        FlowGrpoScheduler(request).step(v, 0.9, x, 0.1)
    scheduler = FlowGrpoScheduler(request)
    schedule = shifted_schedule(PARAMS.num_points, PARAMS.timestep_shift)
    for i in range(PARAMS.num_steps):
        scheduler.step(v, schedule[i], x, schedule[i] - schedule[i + 1])
    with pytest.raises(RuntimeError, match="past the schedule"):
        scheduler.step(v, 0.0, x, 0.0)


def test_the_engine_says_what_to_install_when_vllm_omni_is_missing(tiny: Path) -> None:
    if importlib.util.find_spec("vllm_omni") is not None:
        pytest.skip("vLLM-Omni is installed here")
    from flowgrpo.services.rollout.omni.engine import VllmOmniBagelEngine

    with pytest.raises(RuntimeError, match=r"needs vLLM-Omni installed.*docs/rollout-engines\.md"):
        VllmOmniBagelEngine.from_checkpoint(tiny, device="cpu", dtype=torch.bfloat16)
