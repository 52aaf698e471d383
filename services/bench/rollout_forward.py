"""The rollout benchmark's forward-level measurements (``flowgrpo bench rollout``): one CFG
forward through the general and the query path, eager, compiled and CUDA-graphed; SDPA backends
on the query's attention shapes; bf16-vs-fp32 velocity drift."""

from __future__ import annotations

import contextlib
import math
from collections.abc import Callable
from dataclasses import dataclass, replace
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor

from flowgrpo.models.bagel.attention import KVCache
from flowgrpo.models.bagel.config import BagelConfig, SpecialTokens
from flowgrpo.models.bagel.model import BagelModel, latent_position_ids, query_mask
from flowgrpo.models.bagel.sampling import SampleRequest, prefill_prompts, with_cfg_branches
from flowgrpo.models.bagel.vae import AutoEncoder
from flowgrpo.sampler_params import SamplerParams
from flowgrpo.services.bench.common import (
    SPECIAL_7B,
    SPECIAL_TINY,
    make_requests,
    random_bagel,
    spec_step_flops,
)
from flowgrpo.services.bench.stats import timed


@dataclass
class Setup:
    model: BagelModel
    vae: AutoEncoder
    special: SpecialTokens
    device: torch.device
    prompt_len: int
    num_points: int
    repeats: int  # timed runs per figure, after one warm-up


# --- one CFG forward ------------------------------------------------------------------------------


def build_context(model: BagelModel, requests: list[SampleRequest]) -> KVCache:
    """What the sampler does before its loop: prefill each distinct prompt, one row per sample,
    then the empty-context (text-unconditional) rows."""
    uids = list(dict.fromkeys(r.prompt_uid for r in requests))
    prompts = [next(r.prompt_ids for r in requests if r.prompt_uid == uid) for uid in uids]
    cache = prefill_prompts(model, prompts)
    rows = torch.tensor([uids.index(r.prompt_uid) for r in requests], device=cache.key_mask.device)
    return with_cfg_branches(model, cache.select(rows), SamplerParams())


def context_lengths(requests: list[SampleRequest]) -> list[int]:
    """Context length of every row of the CFG forward: the conditional rows, then the empty ones."""
    return [r.prompt_ids.numel() for r in requests] + [0] * len(requests)


def cfg_forward(
    model: BagelModel, special: SpecialTokens, context: KVCache, x: Tensor, t: Tensor
) -> Callable[[], Tensor]:
    """One denoising forward of both CFG branches (what ``guided_velocity`` runs before combining)."""
    side = math.isqrt(x.shape[1])
    pos = latent_position_ids(side, side, model.config.max_latent_size, x.device)
    markers = {"soi_id": special.vision_start, "eoi_id": special.vision_end}
    xx, tt = torch.cat([x, x]), torch.cat([t, t])
    return lambda: model.predict_velocity(context, xx, tt, pos, **markers)


def step_inputs(model: BagelModel, batch: int, resolution: int) -> tuple[Tensor, Tensor]:
    """Random latents [batch, N, 64] and their times (one denoising step's inputs)."""
    device = model.vae2llm.weight.device
    g = torch.Generator(device=device).manual_seed(1)
    n = (resolution // 16) ** 2
    x = torch.randn(batch, n, model.config.latent_token_dim, device=device, generator=g)
    return x, torch.linspace(1.0, 0.1, batch, device=device)


def step_forward(setup: Setup, resolution: int, batch: int) -> tuple[Callable[[], Tensor], float]:
    """The CFG forward of a batch (fresh context and inputs) and its SPEC-7 FLOPs."""
    requests = make_requests(batch, setup.prompt_len, setup.special)
    context = build_context(setup.model, requests)
    x, t = step_inputs(setup.model, batch, resolution)
    flops = spec_step_flops(setup.model.config, x.shape[1], context_lengths(requests))
    return cfg_forward(setup.model, setup.special, context, x, t), flops


def general_path(
    model: BagelModel, special: SpecialTokens, context: KVCache, x: Tensor, t: Tensor
) -> Callable[[], Tensor]:
    """The same CFG forward through the general decoder path (routing gathers, one masked SDPA
    call with repeated K/V; what the one-pass training forward uses, and what ``predict_velocity``
    ran before the static query path)."""
    b, n = 2 * x.shape[0], x.shape[1]
    side = math.isqrt(n)
    pos = latent_position_ids(side, side, model.config.max_latent_size, x.device)
    markers = {"soi_id": special.vision_start, "eoi_id": special.vision_end}
    xx, tt = torch.cat([x, x]), torch.cat([t, t])

    def run() -> Tensor:
        embeds, is_gen = model.image_query(xx, tt, pos, **markers)
        positions = context.lengths[:, None].expand(b, n + 2)
        mask = query_mask(context.key_mask, n + 2)
        hidden, _ = model.decoder(embeds, is_gen, positions, mask, past=context)
        velocity: Tensor = model.llm2vae(hidden[:, 1 : n + 1])
        return velocity.float()

    return run


def cuda_graphed(fn: Callable[[], Tensor]) -> Callable[[], Tensor]:
    """Capture ``fn`` (whose inputs stay put) once; the returned callable replays it."""
    stream = torch.cuda.Stream()  # type: ignore[no-untyped-call]
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        for _ in range(2):
            fn()
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = fn()

    def replay() -> Tensor:
        graph.replay()
        return out

    return replay


def rel_err(a: Tensor, b: Tensor) -> float:
    return float((a.float() - b.float()).norm() / b.float().norm())


# --- the ways of running it -------------------------------------------------------------------------


@torch.no_grad()
def forward_variants(setup: Setup, shapes: list[tuple[int, int]], *, compiled: bool) -> list[dict[str, Any]]:
    """Step time (and FLOPs, for MFU) of each way of running one CFG forward, and the relative
    difference of its velocity from the general path's. ``compiled``: whether the query layers
    are compiled now."""
    return [row for resolution, batch in shapes for row in _variants(setup, resolution, batch, compiled)]


def _variants(setup: Setup, resolution: int, batch: int, compiled: bool) -> list[dict[str, Any]]:
    requests = make_requests(batch, setup.prompt_len, setup.special)
    context = build_context(setup.model, requests)
    x, t = step_inputs(setup.model, batch, resolution)
    flops = spec_step_flops(setup.model.config, x.shape[1], context_lengths(requests))
    reference = general_path(setup.model, setup.special, context, x, t)()
    query = cfg_forward(setup.model, setup.special, context, x, t)
    variants: dict[str, Callable[[], Tensor]] = {}
    if compiled:
        variants["query-compiled"] = query
        if setup.device.type == "cuda" and batch <= 8:
            variants["query-compiled-cudagraph"] = cuda_graphed(query)
    else:
        variants["general-eager"] = general_path(setup.model, setup.special, context, x, t)
        variants["query-eager"] = query
    rows = []
    for name, fn in variants.items():
        seconds = timed(fn, device=setup.device, repeats=setup.repeats)
        row = {"variant": name, "resolution": resolution, "batch": batch, "step_s": seconds, "flops": flops}
        row["rel_diff"] = rel_err(fn(), reference)
        rows.append(row)
        achieved = seconds.per(flops / 1e12, "TFLOP/s")
        print(f"  {name:26s} {resolution}px b{batch}: {seconds.scaled(1e3, 'ms'):.1f}, {achieved:.1f}, "
              f"rel. diff from general-eager {row['rel_diff']:.2e}", flush=True)  # fmt: skip
    return rows


def sdpa_cases(q: Tensor, k: Tensor, v: Tensor) -> dict[str, tuple[list[Any] | None, Callable[[], Tensor]]]:
    """name -> (SDPA backends to allow, or None for the default choice; the call)."""
    from torch.nn.attention import SDPBackend

    sdpa = F.scaled_dot_product_attention
    groups = q.shape[1] // k.shape[1]
    kr, vr = k.repeat_interleave(groups, 1), v.repeat_interleave(groups, 1)
    bias = torch.zeros(q.shape[0], 1, q.shape[2], k.shape[2], device=q.device, dtype=q.dtype)
    return {
        "bias+repeat (general path)": (None, lambda: sdpa(q, kr, vr, attn_mask=bias)),
        "gqa default": (None, lambda: sdpa(q, k, v, enable_gqa=True)),
        "gqa flash": ([SDPBackend.FLASH_ATTENTION], lambda: sdpa(q, k, v, enable_gqa=True)),
        "gqa cudnn": ([SDPBackend.CUDNN_ATTENTION], lambda: sdpa(q, k, v, enable_gqa=True)),
        "repeat cudnn": ([SDPBackend.CUDNN_ATTENTION], lambda: sdpa(q, kr, vr)),
        "repeat efficient": ([SDPBackend.EFFICIENT_ATTENTION], lambda: sdpa(q, kr, vr)),
    }


@torch.no_grad()
def attention_backends(setup: Setup, shapes: list[tuple[int, int]]) -> list[dict[str, Any]]:
    """SDPA on the query's shapes (every row: prompt_len context keys + the query's), by backend:
    the general path's call (additive bias, repeated K/V) and unmasked GQA calls."""
    from torch.nn.attention import sdpa_kernel

    cfg, device, out = setup.model.config, setup.device, []
    for resolution, batch in shapes:
        t = (resolution // 16) ** 2 + 2
        s = t + setup.prompt_len
        q = torch.randn(2 * batch, cfg.heads, t, cfg.head_dim, device=device, dtype=torch.bfloat16)
        k = torch.randn(2 * batch, cfg.kv_heads, s, cfg.head_dim, device=device, dtype=q.dtype)
        flops = 4 * q.shape[0] * cfg.heads * t * s * cfg.head_dim
        for name, (backends, fn) in sdpa_cases(q, k, torch.randn_like(k)).items():
            row: dict[str, Any] = {"case": name, "resolution": resolution, "batch": batch}
            try:
                with sdpa_kernel(backends) if backends else contextlib.nullcontext():
                    seconds = timed(fn, device=device, warmup=2, repeats=max(setup.repeats, 5))
                row |= {"ms": seconds.scaled(1e3, "ms"), "tflops": seconds.per(flops / 1e12, "TFLOP/s")}
                figure = f"{row['ms']:.2f}, {row['tflops']:.0f}"
            except RuntimeError as e:  # a backend that refuses these inputs
                row["error"] = figure = str(e).strip().splitlines()[0][:160]
            out.append(row)
            print(f"  attention {resolution}px b{batch} {name:28s} {figure}", flush=True)
    return out


# --- precision ----------------------------------------------------------------------------------------


@torch.no_grad()
def velocity_drift(
    cfg: BagelConfig, device: torch.device, resolution: int, prompt_lens: list[int], *, init: bool
) -> dict[str, Any]:
    """Relative error of bf16 velocities against fp32 ones (TF32 off) of the same weights: the
    conditional and empty-context rows of prompts of different lengths, at t from 1 to 0.1.
    ``init``: the model's init_weights (std 0.02) rather than PyTorch's default initialisation."""
    if init:
        model = random_bagel(cfg, torch.float32, device)
    else:
        torch.manual_seed(0)
        model = BagelModel(cfg).to(device).eval()
    special = SPECIAL_7B if cfg.vocab > SPECIAL_7B.vision_end else SPECIAL_TINY
    requests = [make_requests(1, n, special, seed=i)[0] for i, n in enumerate(prompt_lens)]
    requests = [replace(r, prompt_uid=f"p{i}") for i, r in enumerate(requests)]
    x, t = step_inputs(model, len(requests), resolution)

    def velocities() -> tuple[Tensor, Tensor]:
        """(query path, general path) velocities of the CFG forward."""
        context = build_context(model, requests)
        return cfg_forward(model, special, context, x, t)(), general_path(model, special, context, x, t)()

    v32, general32 = velocities()
    model.to(torch.bfloat16)
    v16, general16 = velocities()
    per_row = ((v16 - v32).flatten(1).norm(dim=1) / v32.flatten(1).norm(dim=1)).tolist()
    return {
        "rel_err": rel_err(v16, v32),
        "rel_err_max_row": max(per_row),
        "rows": len(per_row),
        # the same for the general (training) path: the query path adds no error of its own ...
        "general_path_rel_err": rel_err(general16, general32),
        # ... and in fp32 both paths compute the same function
        "query_vs_general_fp32": rel_err(v32, general32),
    }
