"""BAGEL text-to-image rollout throughput and MFU on one GPU (``flowgrpo bench rollout``).

The real 7B geometry with random bf16 weights (built on the meta device, ``to_empty``,
``init_weights``: no checkpoint needed) and the FLUX VAE geometry with random weights. For each
(resolution, batch): 14-step (15-point) FlowGRPO rollouts with text CFG 4, the conditional and
the empty-context rows in one forward, through ``BagelSampler.generate``. Reported per row:

- images/s end to end (context prefill + denoising loop + VAE decode);
- the denoising step (one CFG forward, median) and loop times, and their MFU: FLOPs counted as
  SPEC section 7 (:func:`spec_step_flops`) over time over the bf16 matmul peak measured in the
  same run (8192^3); the loop is the sampler's 14 steps with its SDE math and noise draws;
- the prompt prefill (building the CFG context rows) and the VAE decode, separately;
- peak device memory of the rollout and of the decode.

Also, in the same run: the same forward through the general (training) path, the query path
eager, compiled and CUDA-graphed, and each one's relative velocity difference; SDPA backends on
the query's attention shapes; bf16-vs-fp32 velocity drift on the tiny model and on the 7B.

``--model tiny --device cpu`` runs every code path on the tiny model in seconds (a smoke test;
its figures mean nothing).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import math
import statistics
import time
from collections.abc import Callable, Iterator
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor

from flowgrpo.models.bagel.attention import KVCache
from flowgrpo.models.bagel.config import (
    BagelConfig,
    SpecialTokens,
    VAEConfig,
    bagel_7b,
    flux_vae,
    tiny,
    tiny_vae,
)
from flowgrpo.models.bagel.model import BagelModel, latent_position_ids, query_mask, unpatchify
from flowgrpo.models.bagel.parallelize import compile_query_layers, uncompile_query_layers
from flowgrpo.models.bagel.sampling import (
    BagelSampler,
    SampleRequest,
    prefill_prompts,
    with_cfg_branches,
)
from flowgrpo.models.bagel.vae import AutoEncoder, images_to_uint8
from flowgrpo.sampler_params import SamplerParams

GROUP = 16  # samples per prompt (FlowGRPO's G): a batch holds ceil(batch / 16) distinct prompts
# The 7B's special-token ids (SPEC section 1); no tokenizer is loaded here.
SPECIAL_7B = SpecialTokens(im_start=151644, im_end=151645, vision_start=151652, vision_end=151653)
GiB = 1 << 30


# --- FLOPs (SPEC section 7) -----------------------------------------------------------------


def gen_matmul_params(cfg: BagelConfig) -> int:
    """Matmul parameters of the generation expert's layers (6.525e9 for the 7B)."""
    q_dim, kv_dim = cfg.heads * cfg.head_dim, cfg.kv_heads * cfg.head_dim
    per_layer = 2 * cfg.hidden * q_dim + 2 * cfg.hidden * kv_dim + 3 * cfg.hidden * cfg.intermediate
    return cfg.layers * per_layer


def spec_step_flops(cfg: BagelConfig, latent_tokens: int, context_lengths: list[int]) -> float:
    """Forward FLOPs of one denoising step: per row (every CFG branch of every sample is a row)
    2 x gen matmul params x T + 4 x T x K x head_dim x heads x layers, with T = N + 2 query tokens
    and K = the row's context length + T keys."""
    t = latent_tokens + 2
    attn = 4 * t * cfg.head_dim * cfg.heads * cfg.layers
    return float(sum(2 * gen_matmul_params(cfg) * t + attn * (length + t) for length in context_lengths))


# --- timing ---------------------------------------------------------------------------------


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def timed(fn: Callable[[], Any], device: torch.device, *, warmup: int = 1, reps: int = 3) -> float:
    """Median seconds of ``fn`` after ``warmup`` calls: CUDA events on a GPU, the wall clock else."""
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(reps):
        if device.type == "cuda":
            start = torch.cuda.Event(enable_timing=True)  # type: ignore[no-untyped-call]
            end = torch.cuda.Event(enable_timing=True)  # type: ignore[no-untyped-call]
            start.record()
            fn()
            end.record()
            end.synchronize()
            times.append(start.elapsed_time(end) / 1e3)
        else:
            begin = time.perf_counter()
            fn()
            times.append(time.perf_counter() - begin)
    return float(statistics.median(times))


def wall(fn: Callable[[], Any], device: torch.device) -> tuple[float, Any]:
    """Seconds of one call, host work included (the sampler draws noise on the CPU)."""
    sync(device)
    begin = time.perf_counter()
    out = fn()
    sync(device)
    return time.perf_counter() - begin, out


def matmul_peak_tflops(device: torch.device, size: int = 8192) -> float:
    """bf16 matmul rate on random data, the MFU denominator (SPEC section 7)."""
    a = torch.randn(size, size, device=device, dtype=torch.bfloat16)
    b = torch.randn(size, size, device=device, dtype=torch.bfloat16)
    seconds = timed(lambda: a @ b, device, warmup=3, reps=10)
    return 2 * size**3 / seconds / 1e12


@contextlib.contextmanager
def peak_memory(device: torch.device, into: dict[str, float], key: str) -> Iterator[None]:
    """Record the peak allocated device memory (GiB) of the block."""
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
    yield
    if device.type == "cuda":
        into[key] = torch.cuda.max_memory_allocated(device) / GiB


# --- models with random weights ----------------------------------------------------------------


def random_bagel(cfg: BagelConfig, dtype: torch.dtype, device: torch.device, seed: int = 0) -> BagelModel:
    """Built on the meta device (no host copy of 28 GB), then materialised and initialised."""
    with torch.device("meta"):
        model = BagelModel(cfg).to(dtype)
    model.to_empty(device=device)
    model.init_weights(generator=torch.Generator(device=device).manual_seed(seed))
    return model.eval()


def random_vae(cfg: VAEConfig, dtype: torch.dtype, device: torch.device) -> AutoEncoder:
    """The decoder only, with PyTorch's default initialisation."""
    torch.manual_seed(0)
    with torch.device(device):
        vae = AutoEncoder(replace(cfg, has_encoder=False))
    return vae.to(dtype).eval()


# --- one benchmark row -------------------------------------------------------------------------


@dataclass
class Row:
    resolution: int
    batch: int
    prompts: int
    images_per_s: float
    step_s: float
    loop_s: float
    mfu_step: float
    mfu_loop: float
    prefill_s: float
    decode_s: float
    rollout_s: float
    step_tflop: float
    peak_rollout_gib: float = float("nan")
    peak_decode_gib: float = float("nan")


@dataclass
class Setup:
    model: BagelModel
    vae: AutoEncoder
    special: SpecialTokens
    device: torch.device
    peak_tflops: float
    prompt_len: int
    num_points: int


def make_requests(batch: int, prompt_len: int, special: SpecialTokens, seed: int = 0) -> list[SampleRequest]:
    """``batch`` samples of ceil(batch / GROUP) prompts [im_start, body, im_end]; prompt j has
    prompt_len + 8 j tokens, so the conditional rows of several prompts differ in length."""
    g = torch.Generator().manual_seed(seed)
    out = []
    for j in range(math.ceil(batch / GROUP)):
        body = torch.randint(0, special.im_start, (prompt_len + 8 * j - 2,), generator=g)
        ids = torch.cat([torch.tensor([special.im_start]), body, torch.tensor([special.im_end])])
        out += [SampleRequest(f"p{j}", s, ids) for s in range(min(GROUP, batch - j * GROUP))]
    return out


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


@torch.no_grad()
def measure(setup: Setup, resolution: int, batch: int, *, step_reps: int) -> Row:
    """One table row: prefill, step, a full rollout through the sampler, VAE decode."""
    device, cfg = setup.device, setup.model.config
    params = SamplerParams(
        num_points=setup.num_points, height=resolution, width=resolution, decode_images=False
    )
    requests = make_requests(batch, setup.prompt_len, setup.special)
    memory: dict[str, float] = {}

    prefill_s = timed(lambda: build_context(setup.model, requests), device, warmup=1, reps=5)
    forward, flops = step_forward(setup, resolution, batch)
    step_s = timed(forward, device, warmup=1, reps=step_reps)
    del forward

    sampler = BagelSampler(setup.model, setup.vae, setup.special)
    with peak_memory(device, memory, "rollout"):
        rollout_s, out = wall(lambda: sampler.generate(requests, params, seed=0, step=0), device)
    side = resolution // 16
    latent = unpatchify(out.final_latents, side, side, cfg.patch).to(next(setup.vae.parameters()).dtype)
    with peak_memory(device, memory, "decode"):
        decode_s = timed(lambda: images_to_uint8(setup.vae.decode(latent)), device, warmup=1, reps=2)
    loop_s = rollout_s - prefill_s
    peak = setup.peak_tflops * 1e12
    return Row(
        resolution=resolution,
        batch=batch,
        prompts=len({r.prompt_uid for r in requests}),
        images_per_s=batch / (rollout_s + decode_s),
        step_s=step_s,
        loop_s=loop_s,
        mfu_step=flops / step_s / peak,
        mfu_loop=(setup.num_points - 1) * flops / loop_s / peak,
        prefill_s=prefill_s,
        decode_s=decode_s,
        rollout_s=rollout_s,
        step_tflop=flops / 1e12,
        peak_rollout_gib=memory.get("rollout", math.nan),
        peak_decode_gib=memory.get("decode", math.nan),
    )


# --- variants of the forward -----------------------------------------------------------------


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


@torch.no_grad()
def forward_variants(
    setup: Setup, shapes: list[tuple[int, int]], *, compiled: bool, reps: int
) -> list[dict[str, Any]]:
    """Step time and MFU of each way of running one CFG forward, and the relative difference of
    its velocity from the general path's. ``compiled``: whether the query layers are compiled now."""
    return [
        row for resolution, batch in shapes for row in _variants(setup, resolution, batch, compiled, reps)
    ]


def _variants(setup: Setup, resolution: int, batch: int, compiled: bool, reps: int) -> list[dict[str, Any]]:
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
        seconds = timed(fn, setup.device, warmup=1, reps=reps)
        mfu = flops / seconds / (setup.peak_tflops * 1e12)
        row = {"variant": name, "resolution": resolution, "batch": batch, "step_s": seconds, "mfu": mfu}
        row["rel_diff"] = rel_err(fn(), reference)
        rows.append(row)
        print(
            f"  {name:26s} {resolution}px b{batch}: {seconds * 1e3:8.1f} ms  MFU {mfu:.1%}  "
            f"rel. diff from general-eager {row['rel_diff']:.2e}",
            flush=True,
        )
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
                    seconds = timed(fn, device, warmup=2, reps=5)
                row |= {"ms": seconds * 1e3, "tflops": flops / seconds / 1e12}
                figure = f"{row['ms']:8.2f} ms {row['tflops']:6.0f} TFLOP/s"
            except RuntimeError as e:  # a backend that refuses these inputs
                row["error"] = figure = str(e).strip().splitlines()[0][:160]
            out.append(row)
            print(f"  attention {resolution}px b{batch} {name:28s} {figure}", flush=True)
    return out


# --- precision ----------------------------------------------------------------------------------


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


# --- the run ----------------------------------------------------------------------------------------


def parse_shapes(text: str) -> list[tuple[int, int]]:
    """'512x8,1024x8' -> [(512, 8), (1024, 8)] (resolution x batch); '' -> []."""
    shapes = []
    for item in filter(None, text.split(",")):
        resolution, batch = item.lower().split("x")
        shapes.append((int(resolution), int(batch)))
    return shapes


def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    device = torch.device(args.device)
    if device.type == "cuda" and not torch.cuda.is_available():
        print("flowgrpo bench rollout needs a CUDA device (or --model tiny --device cpu for a smoke test)")
        return 2
    # TF32 off: the bf16 model's matmuls are bf16, its fp32 parts (norm statistics, RoPE, the
    # sampler) stay true fp32, and the fp32 drift reference is fp32.
    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.allow_tf32 = False
    torch.backends.cudnn.benchmark = True  # the VAE's convolutions (fixed shapes per row)
    report: dict[str, Any] = {"args": vars(args), "torch": torch.__version__, "device": _device_name(device)}
    report["matmul_peak_tflops"] = matmul_peak_tflops(device, 8192 if device.type == "cuda" else 512)
    print(f"{report['device']}: bf16 matmul peak {report['matmul_peak_tflops']:.0f} TFLOP/s", flush=True)
    setup = _setup(args, device, report["matmul_peak_tflops"])
    variant_shapes = parse_shapes(args.variants)
    if variant_shapes:
        print("forward variants, eager:", flush=True)
        report["variants"] = forward_variants(setup, variant_shapes, compiled=False, reps=args.step_reps)
        _write(args.json, report)
    if args.compile:
        compile_query_layers(
            setup.model, mode=args.compile_mode, dynamic=_DYNAMIC[args.dynamic], backend=args.compile_backend
        )
        try:
            report["compile_s"] = _first_compiled_forward(setup, parse_shapes(args.shapes)[0])
        except Exception as e:  # report it and measure the eager path rather than nothing
            report["compile_error"] = repr(e)[:2000]
            print(f"compile failed, measuring eager: {e!r}"[:2000], flush=True)
            uncompile_query_layers(setup.model)
            args.compile = False
        if args.compile and variant_shapes:
            print("forward variants, compiled:", flush=True)
            report["variants"] += forward_variants(setup, variant_shapes, compiled=True, reps=args.step_reps)
    report["rows"] = []
    for resolution, batch in parse_shapes(args.shapes):
        row = measure(setup, resolution, batch, step_reps=args.step_reps)
        report["rows"].append(asdict(row))
        _print_row(row)
        _write(args.json, report)
    if device.type == "cuda" and args.attention:
        report["attention"] = attention_backends(setup, variant_shapes or parse_shapes(args.shapes))
    _release(setup)
    report["drift_tiny"] = velocity_drift(tiny(), device, 64, [3, 7, 5, 11], init=False)
    if args.model == "7b" and args.drift_7b:
        report["drift_7b"] = velocity_drift(bagel_7b(), device, 512, [args.prompt_len], init=True)
    print(
        "bf16 vs fp32 velocity drift:", {k: v for k, v in report.items() if k.startswith("drift")}, flush=True
    )
    _write(args.json, report)
    _print_table(report)
    return 0


SPECIAL_TINY = SpecialTokens(im_start=384, im_end=385, vision_start=386, vision_end=387)  # make_tiny_bagel's
_DYNAMIC = {"true": True, "false": False, "auto": None}
_DTYPES = {"bf16": torch.bfloat16, "fp32": torch.float32}


def _device_name(device: torch.device) -> str:
    return torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"


def _setup(args: argparse.Namespace, device: torch.device, peak_tflops: float) -> Setup:
    seven_b, dtype = args.model == "7b", _DTYPES[args.dtype]
    return Setup(
        model=random_bagel(bagel_7b() if seven_b else tiny(), dtype, device),
        vae=random_vae(flux_vae() if seven_b else tiny_vae(), dtype, device),
        special=SPECIAL_7B if seven_b else SPECIAL_TINY,
        device=device,
        peak_tflops=peak_tflops,
        prompt_len=args.prompt_len,
        num_points=args.num_points,
    )


@torch.no_grad()
def _first_compiled_forward(setup: Setup, shape: tuple[int, int]) -> float:
    """Seconds of the first compiled forward: mostly compilation."""
    forward, _ = step_forward(setup, *shape)
    seconds, _ = wall(forward, setup.device)
    print(f"compile: first compiled forward ({shape[0]}px b{shape[1]}) took {seconds:.1f} s", flush=True)
    return seconds


def _release(setup: Setup) -> None:
    """Free the benchmark model before the fp32 references (compiled code holds its layers)."""
    uncompile_query_layers(setup.model)
    torch.compiler.reset()
    setup.model.to("meta")
    setup.vae.to("meta")
    if setup.device.type == "cuda":
        torch.cuda.empty_cache()


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="flowgrpo bench rollout", description=__doc__.split("\n\n")[0])
    p.add_argument("--model", choices=["7b", "tiny"], default="7b", help="geometry (random weights)")
    p.add_argument("--device", default="cuda")
    p.add_argument("--dtype", choices=list(_DTYPES), default="bf16", help="weights (fp32: a fast CPU smoke)")
    p.add_argument(
        "--shapes", default="512x8,512x32,512x1,1024x8", help="resolution x batch, comma-separated"
    )
    p.add_argument(
        "--variants", default="512x1,512x8,1024x8", help="shapes for the forward variants ('' = none)"
    )
    p.add_argument("--num-points", type=int, default=15, help="schedule points (steps + 1)")
    p.add_argument("--prompt-len", type=int, default=48, help="tokens of the first prompt (the next +8 each)")
    p.add_argument("--step-reps", type=int, default=3, help="timed forwards per step figure (median)")
    p.add_argument("--no-compile", dest="compile", action="store_false", help="measure the eager query path")
    p.add_argument("--compile-mode", default=None, help="torch.compile mode (default: inductor's default)")
    p.add_argument(
        "--compile-backend", default="inductor", help="torch.compile backend (aot_eager: a CPU smoke)"
    )
    p.add_argument("--dynamic", choices=list(_DYNAMIC), default="true", help="torch.compile's dynamic")
    p.add_argument(
        "--no-attention", dest="attention", action="store_false", help="skip the SDPA backend table"
    )
    p.add_argument("--no-drift-7b", dest="drift_7b", action="store_false", help="skip the 7B fp32 reference")
    p.add_argument("--json", metavar="PATH", help="write every figure as JSON (rewritten as rows come in)")
    return p


def _write(path: str | None, report: dict[str, Any]) -> None:
    if path:
        Path(path).write_text(json.dumps(report, indent=2, default=str) + "\n")


def _print_row(row: Row) -> None:
    print(
        f"{row.resolution}px b{row.batch}: {row.images_per_s:.2f} img/s, step {row.step_s * 1e3:.0f} ms "
        f"(MFU {row.mfu_step:.1%}), loop {row.loop_s:.2f} s (MFU {row.mfu_loop:.1%}), prefill "
        f"{row.prefill_s * 1e3:.1f} ms, decode {row.decode_s * 1e3:.0f} ms, "
        f"peak {row.peak_rollout_gib:.1f} GiB",
        flush=True,
    )


TABLE = (
    ("res", "{resolution}"),
    ("batch", "{batch}"),
    ("img/s", "{images_per_s:.2f}"),
    ("step ms", "{step_ms:.0f}"),
    ("MFU step", "{mfu_step:.1%}"),
    ("loop s", "{loop_s:.2f}"),
    ("MFU loop", "{mfu_loop:.1%}"),
    ("prefill ms", "{prefill_ms:.1f}"),
    ("decode ms", "{decode_ms:.0f}"),
    ("peak GiB", "{peak_rollout_gib:.1f}"),
    ("decode GiB", "{peak_decode_gib:.1f}"),
)


def _print_table(report: dict[str, Any]) -> None:
    print(
        f"\n{report['device']}, torch {report['torch']}, "
        f"bf16 matmul peak {report['matmul_peak_tflops']:.0f} TFLOP/s (measured in this run)"
    )
    print(" | ".join(name for name, _ in TABLE))
    for r in report["rows"]:
        ms = {
            "step_ms": r["step_s"] * 1e3,
            "prefill_ms": r["prefill_s"] * 1e3,
            "decode_ms": r["decode_s"] * 1e3,
        }
        print(" | ".join(fmt.format(**r, **ms) for _, fmt in TABLE))


if __name__ == "__main__":
    raise SystemExit(main())
