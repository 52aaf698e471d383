"""BAGEL text-to-image rollout throughput and MFU on one GPU (``flowgrpo bench rollout``).

The real 7B geometry with random bf16 weights (built on the meta device, ``to_empty``,
``init_weights``: no checkpoint needed) and the FLUX VAE geometry with random weights. For each
(resolution, batch): 14-step (15-point) FlowGRPO rollouts with text CFG 4, the conditional and
the empty-context rows in one forward, through ``BagelSampler.generate``, then the VAE decode.
Every timed figure is the median of ``--repeats`` (>= 3) runs after a warm-up run, with its
range (services/bench/stats.py). Reported per row:

- images/s end to end (context prefill + denoising loop + VAE decode, timed as one call);
- the denoising loop inside those calls (from the sampler's first ``between_steps`` call to its
  return: the 14 steps with their SDE math and noise draws) and one CFG forward (step), and
  their MFU: FLOPs counted as SPEC section 7 (:func:`spec_step_flops`) over time over the bf16
  matmul peak measured in the same run (8192^3, before and after the timed sections; the larger
  is used, see ``MatmulPeak.used``);
- the prompt prefill (building the CFG context rows) and the VAE decode, separately;
- peak device memory of the rollout and of the decode.

Also, in the same run: the same forward through the general (training) path, the query path
eager, compiled and CUDA-graphed, and each one's relative velocity difference; SDPA backends on
the query's attention shapes; bf16-vs-fp32 velocity drift on the tiny model and on the 7B.

``--branch``: branched rollouts (``SamplerSettings.branch``) of one prompt group
(``--branch-shape``, default 512 px x 16 samples) against unbranched ones, window size 2 placed
at each step of ``--branch-begins`` (``window_strategy=progressive``, the step chosen so the
window begins there; the recipe's random windows in [0, 7] begin at 0-5): images/s end to end,
the loop and its MFU, and the FLOPs per image counted over the forwards that ran (SPEC section
7 per row; a group's prefix steps run one row instead of G). The expected saving under the
recipe's random windows follows from the counted per-step FLOPs.

``--model tiny --device cpu`` runs every code path on the tiny model in seconds (a smoke test;
its figures mean nothing).
"""

from __future__ import annotations

import argparse
import contextlib
import math
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, replace
from typing import Any

import torch
from torch import Tensor

from flowgrpo.models.bagel.config import bagel_7b, flux_vae, tiny, tiny_vae
from flowgrpo.models.bagel.model import BagelModel, unpatchify
from flowgrpo.models.bagel.parallelize import compile_query_layers, uncompile_query_layers
from flowgrpo.models.bagel.sampling import BagelSampler, SampleRequest
from flowgrpo.models.bagel.vae import images_to_uint8
from flowgrpo.sampler_math import window_begin
from flowgrpo.sampler_params import SamplerParams
from flowgrpo.services.bench.common import (
    DTYPES,
    SPECIAL_7B,
    SPECIAL_TINY,
    GiB,
    MatmulPeak,
    Stopwatch,
    device_name,
    make_requests,
    mfu,
    open_device,
    peak_memory,
    random_bagel,
    random_vae,
    spec_step_flops,
)
from flowgrpo.services.bench.rollout_forward import (
    Setup,
    attention_backends,
    build_context,
    forward_variants,
    step_forward,
    velocity_drift,
)
from flowgrpo.services.bench.stats import (
    MIN_REPEATS,
    Figure,
    Runs,
    ratio,
    repeats_arg,
    run_timed,
    time_call,
    timed,
    write_json,
)


@dataclass
class Row:
    resolution: int
    batch: int
    prompts: int
    step_tflop: float  # SPEC-7 FLOPs of one CFG forward of the batch, / 1e12
    images_per_s: Figure  # batch / end_to_end_s
    end_to_end_s: Figure  # sampler (prefill + loop) + decode, one call
    loop_s: Figure  # the denoising loop inside those calls
    step_s: Figure  # one CFG forward
    prefill_s: Figure
    decode_s: Figure
    peak_rollout_gib: float = math.nan
    peak_decode_gib: float = math.nan
    mfu_step: Figure | None = None  # set once the peak after the timed sections is known
    mfu_loop: Figure | None = None


@dataclass
class BranchRow:
    """One group's rollouts, branched or not, with its window at ``begin``."""

    resolution: int
    group: int  # samples of the one prompt
    branch: bool
    begin: int  # the window's first step; a branched group's prefix is steps 0 .. begin - 1
    forward_rows: list[int]  # rows of each forward of one rollout (CFG branches counted)
    forward_tflop: list[float]  # SPEC-7 FLOPs of each of those forwards / 1e12
    tflop_per_image: float  # counted: SPEC-7 FLOPs of every forward of one rollout / group / 1e12
    images_per_s: Figure
    end_to_end_s: Figure
    loop_s: Figure
    mfu_loop: Figure | None = None
    flops_fraction: float = 1.0  # counted FLOPs over the unbranched row's


@dataclass
class GuidanceRow:
    """Rollouts of one shape with text CFG (``cfg_text_scale`` > 1: a conditional and an
    empty-context row per sample and step) or CFG-free (1: the conditional row alone)."""

    resolution: int
    batch: int
    cfg_text_scale: float
    forward_rows: list[int]  # rows of each forward of one rollout
    tflop_per_image: float  # counted: SPEC-7 FLOPs of every forward of one rollout / batch / 1e12
    images_per_s: Figure
    end_to_end_s: Figure
    loop_s: Figure
    mfu_loop: Figure | None = None


@dataclass
class RolloutRun:
    """One end-to-end call's loop time, peak memory while sampling, and final latents."""

    loop_s: float
    peak_gib: float
    latent: Tensor


# --- one row -------------------------------------------------------------------------------------


@torch.no_grad()
def measure(setup: Setup, resolution: int, batch: int) -> Row:
    """One table row: prefill, step, end-to-end rollouts through the sampler, VAE decode."""
    device, repeats = setup.device, setup.repeats
    requests = make_requests(batch, setup.prompt_len, setup.special)
    prefill_s = timed(lambda: build_context(setup.model, requests), device=device, repeats=max(repeats, 5))
    forward, flops = step_forward(setup, resolution, batch)
    step_s = timed(forward, device=device, repeats=repeats)
    del forward
    runs = run_timed(lambda: _rollout(setup, requests, resolution), device=device, repeats=repeats)
    memory: dict[str, float] = {}
    latent = runs.outputs[-1].latent
    with peak_memory(device, memory, "decode"):
        decode_s = timed(lambda: images_to_uint8(setup.vae.decode(latent)), device=device, repeats=repeats)
    return Row(
        resolution=resolution,
        batch=batch,
        prompts=len({r.prompt_uid for r in requests}),
        step_tflop=flops / 1e12,
        images_per_s=runs.seconds.per(batch, "images/s"),
        end_to_end_s=runs.seconds,
        loop_s=Figure.of([r.loop_s for r in runs.outputs]),
        step_s=step_s,
        prefill_s=prefill_s,
        decode_s=decode_s,
        peak_rollout_gib=max(r.peak_gib for r in runs.outputs),
        peak_decode_gib=memory.get("decode", math.nan),
    )


def _rollout(
    setup: Setup, requests: list[SampleRequest], resolution: int, params: SamplerParams | None = None,
    step: int = 0,
) -> RolloutRun:  # fmt: skip
    """One end-to-end rollout: the sampler (its loop marked from the first ``between_steps``
    call to its return), then the VAE decode of the final latents."""
    device, cfg = setup.device, setup.model.config
    if params is None:
        params = SamplerParams(
            num_points=setup.num_points, height=resolution, width=resolution, decode_images=False
        )
    sampler = BagelSampler(setup.model, setup.vae, setup.special)
    clock = Stopwatch(device)
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
    out = sampler.generate(requests, params, seed=0, step=step, between_steps=lambda: clock.mark("loop"))
    clock.mark("sampled")
    peak = torch.cuda.max_memory_allocated(device) / GiB if device.type == "cuda" else math.nan
    side = resolution // 16
    latent = unpatchify(out.final_latents, side, side, cfg.patch).to(next(setup.vae.parameters()).dtype)
    images_to_uint8(setup.vae.decode(latent))
    return RolloutRun(clock.seconds("loop", "sampled"), peak, latent)


# --- branched rollouts ----------------------------------------------------------------------------


@torch.no_grad()
def measure_branching(
    setup: Setup, resolution: int, group: int, begins: list[int], in_time: Callable[[str], bool] | None = None
) -> list[BranchRow]:
    """One group's rollouts unbranched (window at ``begins[0]``), then branched at each begin (those
    that ``in_time`` still allows)."""
    requests = make_requests(group, setup.prompt_len, setup.special, group=group)
    base = SamplerParams(num_points=setup.num_points, height=resolution, width=resolution,
                         decode_images=False, window_strategy="progressive")  # fmt: skip
    rows: list[BranchRow] = []
    for branch, begin in [(False, begins[0]), *((True, b) for b in begins)]:
        if rows and in_time is not None and not in_time(f"the branched row at {begin}"):
            break
        params = replace(base, branch=branch)
        row = _branch_row(setup, requests, params, begin)
        if rows:
            row.flops_fraction = row.tflop_per_image / rows[0].tflop_per_image
        rows.append(row)
        _print_branch_row(row)
    return rows


@torch.no_grad()
def measure_guidance(
    setup: Setup, resolution: int, batch: int, scales: tuple[float, ...]
) -> list[GuidanceRow]:
    """The same requests sampled at each text CFG scale (1: CFG-free, flow_grpo's fast recipe and
    UniGRPO's mode): images/s, and the FLOPs counted over the forwards that ran."""
    requests = make_requests(batch, setup.prompt_len, setup.special)
    rows = [_guidance_row(setup, requests, resolution, scale) for scale in scales]
    for row in rows:
        print(f"{resolution}px b{batch} text CFG {row.cfg_text_scale:g}: {row.images_per_s.brief('.2f')} "
              f"images/s, {row.tflop_per_image:.2f} TFLOP/image, rows per forward "
              f"{sorted(set(row.forward_rows))}", flush=True)  # fmt: skip
    return rows


def _guidance_row(setup: Setup, requests: list[SampleRequest], resolution: int, scale: float) -> GuidanceRow:
    params = SamplerParams(num_points=setup.num_points, height=resolution, width=resolution,
                           decode_images=False, cfg_text_scale=scale, cfg_img_scale=1.0)  # fmt: skip
    runs, flops, forward_rows = _counted_runs(setup, requests, params)
    return GuidanceRow(resolution=resolution, batch=len(requests), cfg_text_scale=scale,
                       forward_rows=forward_rows, tflop_per_image=sum(flops) / len(requests) / 1e12,
                       images_per_s=runs.seconds.per(len(requests), "images/s"), end_to_end_s=runs.seconds,
                       loop_s=Figure.of([r.loop_s for r in runs.outputs]))  # fmt: skip


def _counted_runs(
    setup: Setup, requests: list[SampleRequest], params: SamplerParams, step: int = 0
) -> tuple[Runs[RolloutRun], list[float], list[int]]:
    """Timed end-to-end rollouts of ``requests``, and the FLOPs and rows of every forward of one
    rollout, counted on the warm-up run (a device read per forward), not on the timed ones."""
    flops: list[float] = []
    forward_rows: list[int] = []
    calls: list[None] = []

    def rollout() -> RolloutRun:
        calls.append(None)
        first = len(calls) == 1
        with counted_forwards(setup.model, flops, forward_rows) if first else contextlib.nullcontext():
            return _rollout(setup, requests, params.height, params, step)

    return run_timed(rollout, device=setup.device, repeats=setup.repeats), flops, forward_rows


def _branch_row(setup: Setup, requests: list[SampleRequest], params: SamplerParams, begin: int) -> BranchRow:
    step = begin - params.window_range[0]  # progressive windows: begin = lo + step % choices
    if step < 0 or window_begin(params, 0, step, requests[0].prompt_uid) != begin:
        raise ValueError(f"--branch-begins: {begin} is not a window start of window_range "
                         f"{list(params.window_range)} and window_size {params.window_size}")  # fmt: skip
    runs, flops, forward_rows = _counted_runs(setup, requests, params, step)
    group = len(requests)
    return BranchRow(
        resolution=params.height,
        group=group,
        branch=params.branch,
        begin=begin,
        forward_rows=forward_rows,
        forward_tflop=[f / 1e12 for f in flops],
        tflop_per_image=sum(flops) / group / 1e12,
        images_per_s=runs.seconds.per(group, "images/s"),
        end_to_end_s=runs.seconds,
        loop_s=Figure.of([r.loop_s for r in runs.outputs]),
    )


@contextlib.contextmanager
def counted_forwards(model: BagelModel, flops: list[float], rows: list[int]) -> Iterator[None]:
    """Every ``predict_velocity`` inside: its rows and its SPEC-7 FLOPs (each row's context length
    read from the device, so only around untimed calls)."""
    shadowed = model.__dict__.get("predict_velocity")
    forward = model.predict_velocity

    def counted(cache: Any, x_t: Tensor, *args: Any, **kwargs: Any) -> Tensor:
        rows.append(x_t.shape[0])
        flops.append(spec_step_flops(model.config, x_t.shape[1], cache.lengths.tolist()))
        return forward(cache, x_t, *args, **kwargs)

    model.predict_velocity = counted  # type: ignore[method-assign]
    try:
        yield
    finally:
        if shadowed is None:
            del model.predict_velocity
        else:
            model.predict_velocity = shadowed  # type: ignore[method-assign]


def expected_branch_fraction(rows: list[BranchRow], window: tuple[int, int], size: int) -> float:
    """Counted FLOPs of branched rollouts over unbranched ones, averaged over the windows a recipe
    draws (begins uniform in [lo, hi - size]): steps before the begin cost what a counted prefix
    step cost, the others what the unbranched row's steps cost. NaN without a branched row whose
    window begins after step 0 (no prefix step counted)."""
    full = next(r for r in rows if not r.branch).forward_tflop
    prefixed = [r for r in rows if r.branch and r.begin > 0]
    if not prefixed:
        return math.nan
    prefix_step = prefixed[0].forward_tflop[0]
    begins = range(window[0], window[1] - size + 1)
    branched = [sum(prefix_step if i < b else f for i, f in enumerate(full)) for b in begins]
    return sum(branched) / len(branched) / sum(full)


def add_mfu(report: dict[str, Any], peak_tflops: float, num_points: int) -> None:
    """Each row's and forward variant's MFU against the peak chosen after the timed sections."""
    for row in report["rows"]:
        if isinstance(row, Row):
            flops = row.step_tflop * 1e12
            row.mfu_step = mfu(flops, row.step_s, peak_tflops)
            row.mfu_loop = mfu((num_points - 1) * flops, row.loop_s, peak_tflops)
    for variant in report.get("variants", []):
        variant["mfu"] = mfu(variant["flops"], variant["step_s"], peak_tflops)
    for row in report.get("branching", []):
        row.mfu_loop = mfu(row.tflop_per_image * row.group * 1e12, row.loop_s, peak_tflops)
    for row in report.get("guidance", []):
        row.mfu_loop = mfu(row.tflop_per_image * row.batch * 1e12, row.loop_s, peak_tflops)


# --- the run -----------------------------------------------------------------------------------------


def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    device = open_device(args.device, "rollout")
    if device is None:
        return 2
    torch.backends.cudnn.benchmark = True  # the VAE's convolutions (fixed shapes per row)
    report = run(args, device)
    _print_table(report)
    return 0


def run(args: argparse.Namespace, device: torch.device) -> dict[str, Any]:
    """Every figure: the matmul peak, the forward variants (eager, then compiled), the rows, the
    SDPA table, the peak again (MFU against the larger), then the bf16-vs-fp32 drift."""
    started = time.perf_counter()
    report: dict[str, Any] = {"args": vars(args), "torch": torch.__version__, "device": device_name(device)}
    report["once_s"] = {}
    peak = report["matmul_peak"] = MatmulPeak.measure(device)
    print(f"{report['device']}: {peak.line()}", flush=True)
    setup = build_setup(args, device)
    _variants_and_compile(setup, args, report)
    report["rows"] = _rows(setup, args, report, started)
    if args.branch and _in_time(args, started, "the branching rows"):
        (resolution, group), begins = parse_shapes(args.branch_shape)[0], _ints(args.branch_begins)
        branching = report["branching"] = measure_branching(
            setup, resolution, group, begins, lambda what: _in_time(args, started, what)
        )
        report["branch_images_per_s_ratio"] = {  # branched over unbranched, per window begin
            f"begin {r.begin}": ratio(r.images_per_s, branching[0].images_per_s) for r in branching[1:]
        }
        lo_hi, size = SamplerParams().window_range, SamplerParams().window_size
        report["branch_expected_flops_fraction"] = expected_branch_fraction(report["branching"], lo_hi, size)
        write_json(args.json, report)
    if args.cfg_free and _in_time(args, started, "the CFG-free rows"):
        guidance = report["guidance"] = [
            row
            for resolution, batch in parse_shapes(args.cfg_free)
            for row in measure_guidance(setup, resolution, batch, (args.cfg_text_scale, 1.0))
        ]
        report["cfg_free_images_per_s_ratio"] = {  # CFG-free over CFG, per shape
            f"{a.resolution}x{a.batch}": ratio(b.images_per_s, a.images_per_s)
            for a, b in zip(guidance[::2], guidance[1::2], strict=True)
        }
        write_json(args.json, report)
    if device.type == "cuda" and args.attention and _in_time(args, started, "the attention table"):
        report["attention"] = attention_backends(
            setup, parse_shapes(args.variants) or parse_shapes(args.shapes)
        )
    peak.measure_after(device)
    print(f"{peak.line()}; MFU against {peak.used:.4g} TFLOP/s (the larger)", flush=True)
    add_mfu(report, peak.used, args.num_points)
    write_json(args.json, report)  # every timed figure is in: the drift is what is left
    _release(setup)
    _drift(args, device, report, started)
    write_json(args.json, report)
    return report


def _variants_and_compile(setup: Setup, args: argparse.Namespace, report: dict[str, Any]) -> None:
    """The forward variants eager, then (unless --no-compile) the query path compiled, the
    first compiled forward's time (mostly compilation) and the compiled variants."""
    shapes = parse_shapes(args.variants)
    if shapes:
        print("forward variants, eager:", flush=True)
        report["variants"] = forward_variants(setup, shapes, compiled=False)
        write_json(args.json, report)
    if not args.compile:
        return
    compile_query_layers(setup.model, mode=args.compile_mode, dynamic=_DYNAMIC[args.dynamic],
                         backend=args.compile_backend)  # fmt: skip
    try:
        first = (parse_shapes(args.shapes) or parse_shapes(args.branch_shape))[0]
        report["once_s"]["first_compiled_forward"] = _first_compiled_forward(setup, first)
    except Exception as e:  # report it and measure the eager path rather than nothing
        report["compile_error"] = repr(e)[:2000]
        print(f"compile failed, measuring eager: {e!r}"[:2000], flush=True)
        uncompile_query_layers(setup.model)
        args.compile = False
        return
    if shapes:
        print("forward variants, compiled:", flush=True)
        report["variants"] += forward_variants(setup, shapes, compiled=True)


def _rows(setup: Setup, args: argparse.Namespace, report: dict[str, Any], started: float) -> list[Any]:
    rows: list[Any] = []
    report["rows"] = rows
    for resolution, batch in parse_shapes(args.shapes):
        if not _in_time(args, started, f"{resolution}px b{batch}"):
            rows.append({"resolution": resolution, "batch": batch, "error": "skipped: deadline"})
            continue
        row = measure(setup, resolution, batch)
        rows.append(row)
        _print_row(row)
        write_json(args.json, report)
    return rows


def _drift(args: argparse.Namespace, device: torch.device, report: dict[str, Any], started: float) -> None:
    report["drift_tiny"] = velocity_drift(tiny(), device, 64, [3, 7, 5, 11], init=False)
    if args.model == "7b" and args.drift_7b and _in_time(args, started, "the 7B drift"):
        report["drift_7b"] = velocity_drift(bagel_7b(), device, 512, [args.prompt_len], init=True)
    drift = {k: v for k, v in report.items() if k.startswith("drift")}
    print("bf16 vs fp32 velocity drift:", drift, flush=True)


def _in_time(args: argparse.Namespace, started: float, what: str) -> bool:
    if time.perf_counter() - started <= args.deadline_s:
        return True
    print(f"deadline: {what} not measured", flush=True)
    return False


def _ints(text: str) -> list[int]:
    return [int(x) for x in filter(None, text.split(","))]


def parse_shapes(text: str) -> list[tuple[int, int]]:
    """'512x8,1024x8' -> [(512, 8), (1024, 8)] (resolution x batch); '' -> []."""
    shapes = []
    for item in filter(None, text.split(",")):
        resolution, batch = item.lower().split("x")
        shapes.append((int(resolution), int(batch)))
    return shapes


_DYNAMIC = {"true": True, "false": False, "auto": None}


def build_setup(args: argparse.Namespace, device: torch.device) -> Setup:
    """The model, VAE and settings every timed section shares (``--model``, ``--dtype``, ...)."""
    seven_b, dtype = args.model == "7b", DTYPES[args.dtype]
    return Setup(
        model=random_bagel(bagel_7b() if seven_b else tiny(), dtype, device),
        vae=random_vae(flux_vae() if seven_b else tiny_vae(), dtype, device),
        special=SPECIAL_7B if seven_b else SPECIAL_TINY,
        device=device,
        prompt_len=args.prompt_len,
        num_points=args.num_points,
        repeats=args.repeats,
    )


@torch.no_grad()
def _first_compiled_forward(setup: Setup, shape: tuple[int, int]) -> float:
    """Seconds of the first compiled forward: mostly compilation (a one-off, not a figure)."""
    forward, _ = step_forward(setup, *shape)
    seconds, _ = time_call(forward, setup.device)
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
    p.add_argument("--dtype", choices=list(DTYPES), default="bf16", help="weights (fp32: a fast CPU smoke)")
    p.add_argument(
        "--shapes", default="512x8,512x32,512x1,1024x8", help="resolution x batch, comma-separated"
    )
    p.add_argument(
        "--variants", default="512x1,512x8,1024x8", help="shapes for the forward variants ('' = none)"
    )
    p.add_argument("--num-points", type=int, default=15, help="schedule points (steps + 1)")
    p.add_argument("--prompt-len", type=int, default=48, help="tokens of the first prompt (the next +8 each)")
    p.add_argument(
        "--repeats", type=repeats_arg, default=MIN_REPEATS, help=f"timed runs per figure (>= {MIN_REPEATS})"
    )
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
    p.add_argument("--branch", action="store_true", help="also measure branched rollouts of one group")
    p.add_argument("--branch-shape", default="512x16", help="resolution x group size of --branch")
    p.add_argument("--branch-begins", default="0,5", help="window begins of the branched rows")
    p.add_argument(
        "--cfg-free", default="", help="shapes (RESxBATCH,...) also sampled CFG-free beside --cfg-text-scale"
    )
    p.add_argument("--cfg-text-scale", type=float, default=4.0, help="the guided rows' text CFG (--cfg-free)")
    p.add_argument("--deadline-s", type=float, default=1e9, help="skip the rows that would start after this")
    p.add_argument("--json", metavar="PATH", help="write every figure as JSON (rewritten as rows come in)")
    return p


# --- printing ---------------------------------------------------------------------------------------


def _print_row(row: Row) -> None:
    print(
        f"{row.resolution}px b{row.batch}: {row.images_per_s:.2f}; step {row.step_s.scaled(1e3, 'ms'):.0f}, "
        f"loop {row.loop_s:.2f}, prefill {row.prefill_s.scaled(1e3, 'ms'):.1f}, "
        f"decode {row.decode_s.scaled(1e3, 'ms'):.0f}, peak {row.peak_rollout_gib:.1f} GiB",
        flush=True,
    )


def _print_branch_row(row: BranchRow) -> None:
    print(
        f"{row.resolution}px G{row.group} {'branched' if row.branch else 'unbranched'} (window at "
        f"{row.begin}): {row.images_per_s:.2f}; loop {row.loop_s:.2f}, {row.tflop_per_image:.2f} "
        f"TFLOP/image ({row.flops_fraction:.3f} of unbranched; rows per step {row.forward_rows})",
        flush=True,
    )


def _cell(figure: Figure | None, spec: str) -> str:
    return figure.brief(spec) if figure is not None else "n/a"


TABLE: tuple[tuple[str, Callable[[Row], str]], ...] = (  # header, the cell of a row
    ("res", lambda r: f"{r.resolution}"),
    ("batch", lambda r: f"{r.batch}"),
    ("img/s", lambda r: r.images_per_s.brief(".2f")),
    ("step ms", lambda r: r.step_s.scaled(1e3, "ms").brief(".0f")),
    ("MFU step", lambda r: _cell(r.mfu_step, ".1%")),
    ("loop s", lambda r: r.loop_s.brief(".2f")),
    ("MFU loop", lambda r: _cell(r.mfu_loop, ".1%")),
    ("prefill ms", lambda r: r.prefill_s.scaled(1e3, "ms").brief(".1f")),
    ("decode ms", lambda r: r.decode_s.scaled(1e3, "ms").brief(".0f")),
    ("peak GiB", lambda r: f"{r.peak_rollout_gib:.1f}"),
    ("decode GiB", lambda r: f"{r.peak_decode_gib:.1f}"),
)


def _print_table(report: dict[str, Any]) -> None:
    peak: MatmulPeak = report["matmul_peak"]
    repeats = report["args"]["repeats"]
    print(f"\n{report['device']}, torch {report['torch']}, {peak.line()} (measured in this run; "
          f"MFU against {peak.used:.4g}); median (min-max) of {repeats} runs after a warm-up")  # fmt: skip
    print(" | ".join(name for name, _ in TABLE))
    for r in report["rows"]:
        if isinstance(r, Row):
            print(" | ".join(cell(r) for _, cell in TABLE))
        else:
            print(f"{r['resolution']} | {r['batch']} | {r['error']}")
    if report.get("branching"):
        speedup: dict[str, Figure] = report["branch_images_per_s_ratio"]
        print("\nbranched rollouts of one group: res | G | branch | window begin | img/s | vs unbranched | "
              "loop s | MFU loop | TFLOP/image | FLOPs vs unbranched")  # fmt: skip
        for b in report["branching"]:
            versus = speedup.get(f"begin {b.begin}") if b.branch else None
            cells = [f"{b.resolution}", f"{b.group}", "yes" if b.branch else "no", f"{b.begin}",
                     b.images_per_s.brief(".2f"), _cell(versus, ".3f"), b.loop_s.brief(".2f"),
                     _cell(b.mfu_loop, ".1%"), f"{b.tflop_per_image:.2f}",
                     f"{b.flops_fraction:.3f}"]  # fmt: skip
            print(" | ".join(cells))
        fraction = report["branch_expected_flops_fraction"]
        print(f"expected FLOPs of branched / unbranched rollouts under random windows in "
              f"{list(SamplerParams().window_range)}: {fraction:.3f}")  # fmt: skip
    if report.get("guidance"):
        gains: dict[str, Figure] = report["cfg_free_images_per_s_ratio"]
        print("\nguided and CFG-free rollouts: res | batch | text CFG | img/s | vs guided | loop s | "
              "MFU loop | TFLOP/image")  # fmt: skip
        for g in report["guidance"]:
            gain = gains.get(f"{g.resolution}x{g.batch}") if g.cfg_text_scale == 1.0 else None
            cells = [f"{g.resolution}", f"{g.batch}", f"{g.cfg_text_scale:g}", g.images_per_s.brief(".2f"),
                     _cell(gain, ".3f"), g.loop_s.brief(".2f"), _cell(g.mfu_loop, ".1%"),
                     f"{g.tflop_per_image:.2f}"]  # fmt: skip
            print(" | ".join(cells))


if __name__ == "__main__":
    raise SystemExit(main())
