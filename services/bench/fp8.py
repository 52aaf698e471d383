"""FP8 rollouts against bf16 on one GPU (``flowgrpo bench fp8``; docs/fp8.md), every figure in one
run on one model (the 7B geometry, random bf16 weights, as ``bench rollout``):

1. the peaks, before the timed sections and after (MFU divides by the larger): the bf16 matmul
   peak and the FP8 one (``torch._scaled_mm`` of e4m3 operands with row-wise scales, bf16 out),
   both at 8192^3;
2. per shape (``--shapes``): ``bench rollout``'s row (images/s end to end, the denoising loop, one
   CFG forward, peak memory) in bf16, then again with the gen path quantized
   (``fp8.quantize_gen_path``), compiled both (unless ``--no-compile``); FP8 over bf16 in
   images/s, and the loop's MFU against the bf16 peak and against the FP8 one (attention and the
   und path stay bf16, so the FP8 figure is a floor); and where one CFG forward's kernel time
   goes (``bench.kernels``: GEMMs, attention, the compiled fused kernels, the rest; the top
   kernels by name); and before it, each gen-path GEMM alone at the forward's rows in bf16 and in
   FP8 (row-wise and tensor-wise scales) with the quantization of its input (``fp8_gemms``);
   with ``--torchao``, a third row per shape between the two: torchao's row-wise float8 on the
   same layers (``fp8_torchao``), and ours over it in images/s; with ``--fast-accum``, a row
   after ours: the same FP8 layers with Hopper's fast accumulation (``fp8_fast``,
   ``rollout.fp8_fast_accum``), and its log-prob gap beside ours;
3. the log-prob gap: ``--gap-samples`` FP8 rollouts of the first shape with every step an SDE step
   (``--noise-level``), scored under the bf16 weights by the trainer's own recompute
   (``Forwards.window_log_probs``): |logp_bf16 - logp_fp8| per window step, its median, p90, p99
   and max over the samples at each step, and the share of entries whose ratio exp(gap) leaves
   FlowGRPO's trust region [1 - eps, 1 + eps] for each ``--clip`` (1e-5: the BAGEL recipes';
   1e-4: flow_grpo's); and the same for the control, rollouts of the bf16 weights (the gap that
   is not FP8's).

``--model tiny --device cpu`` runs every code path in seconds (PyTorch's reference FP8 kernel; a
smoke test, its figures mean nothing).
"""

from __future__ import annotations

import argparse
import contextlib
import math
import sys
import time
from collections.abc import Iterator
from typing import Any

import torch
from torch import nn

from flowgrpo.algorithms.objective import Forwards, Trajectory
from flowgrpo.models.bagel.fp8 import E4M3, Fp8Linear, quantize_gen_path, quantize_rowwise
from flowgrpo.models.bagel.model import BagelModel
from flowgrpo.models.bagel.parallelize import compile_query_layers, uncompile_query_layers
from flowgrpo.models.bagel.sampling import BagelSampler
from flowgrpo.sampler_params import SamplerParams
from flowgrpo.services.bench import fp8_torchao
from flowgrpo.services.bench.common import (
    DTYPES,
    MatmulPeak,
    device_name,
    free,
    make_requests,
    mfu,
    open_device,
    sync,
)
from flowgrpo.services.bench.fp8_gemms import gemm_table, print_gemms
from flowgrpo.services.bench.kernels import kernel_profile, print_profile
from flowgrpo.services.bench.rollout import Row, build_setup, measure, parse_shapes
from flowgrpo.services.bench.rollout_forward import Setup, step_forward
from flowgrpo.services.bench.stats import Figure, ratio, repeats_arg, timed, write_json

GAP_QUANTILES = (0.5, 0.9, 0.99)


def fp8_matmul_tflops(device: torch.device, size: int) -> Figure:
    """The FP8 GEMM rate on random data: e4m3 operands with row-wise scales, bf16 out (what
    ``Fp8Linear`` calls), warmed up as the bf16 peak is, then the median of 10 timed ones."""
    a, a_scale = quantize_rowwise(torch.randn(size, size, device=device))
    b, b_scale = quantize_rowwise(torch.randn(size, size, device=device))
    out = torch.bfloat16 if device.type == "cuda" else torch.float32

    def gemm() -> torch.Tensor:
        return torch._scaled_mm(a, b.t(), scale_a=a_scale, scale_b=b_scale.t(), out_dtype=out)

    for _ in range(3):
        gemm()
    sync(device)
    return timed(gemm, device=device, warmup=1, repeats=10).per(2 * size**3 / 1e12, "TFLOP/s")


class FrozenPolicy:
    """The ``Policy`` the trainer's recompute reads: a model, nothing trained, itself its own
    reference and old copy."""

    def __init__(self, model: BagelModel) -> None:
        self._model = model

    @property
    def model(self) -> BagelModel:
        return self._model

    def trainable(self) -> dict[str, nn.Parameter]:
        return {}

    def reference(self) -> contextlib.AbstractContextManager[None]:
        return contextlib.nullcontext()

    def keep_old(self) -> None:
        pass

    def old(self) -> contextlib.AbstractContextManager[None]:
        return contextlib.nullcontext()

    def refresh_old(self, decay: float) -> None:
        pass


class OneRank:
    world = 1

    def share(self, rows: list[int]) -> list[tuple[int, bool]]:
        return [(r, True) for r in rows]

    def sum(self, value: torch.Tensor) -> torch.Tensor:
        return value

    def max(self, value: torch.Tensor) -> torch.Tensor:
        return value


@contextlib.contextmanager
def bf16_layers(model: BagelModel, originals: dict[str, torch.Tensor]) -> Iterator[None]:
    """The quantized layers swapped back for linear layers of their unquantized weights, inside."""
    swapped: dict[str, Fp8Linear] = {}
    for name, weight in originals.items():
        layer = model.get_submodule(name)
        assert isinstance(layer, Fp8Linear)
        linear = nn.Linear(layer.in_features, layer.out_features, bias=layer.bias is not None, device="meta")
        linear.weight = nn.Parameter(weight, requires_grad=False)
        if layer.bias is not None:
            linear.bias = layer.bias
        _set(model, name, linear)
        swapped[name] = layer
    try:
        yield
    finally:
        for name, layer in swapped.items():
            _set(model, name, layer)


def _set(model: nn.Module, name: str, module: nn.Module) -> None:
    parent, _, child = name.rpartition(".")
    setattr(model.get_submodule(parent), child, module)


@torch.no_grad()
def logp_gap(
    setup: Setup, originals: dict[str, torch.Tensor], *, resolution: int, samples: int, noise_level: float,
    clips: list[float], quantized: bool = True,
) -> dict[str, Any]:  # fmt: skip
    """FP8 rollouts scored under bf16 by the trainer's recompute: the gap per window step.
    ``quantized=False``: the control, rollouts of the unquantized weights scored the same way (the
    gap a bf16 run has anyway: the sampler's batch against the trainer's micro-batches)."""
    steps = setup.num_points - 1
    params = SamplerParams(num_points=setup.num_points, height=resolution, width=resolution,
                           noise_level=noise_level, window_size=steps, window_range=(0, steps),
                           deterministic=False, decode_images=False)  # fmt: skip
    requests = make_requests(samples, setup.prompt_len, setup.special)
    sampler = BagelSampler(setup.model, setup.vae, setup.special)
    with contextlib.nullcontext() if quantized else bf16_layers(setup.model, originals):
        out = sampler.generate(requests, params, seed=1, step=0)
    batch = [
        Trajectory(
            r.prompt_uid,
            r.sample_index,
            0,
            0.0,
            r.prompt_ids,
            out.latents[i].cpu(),  # on the host, as the trainer fetches them from the bus
            out.log_probs[i].cpu(),
            out.sigmas[i].cpu(),
        )
        for i, r in enumerate(requests)
    ]
    forwards = Forwards(FrozenPolicy(setup.model), setup.special, OneRank(), micro_batch_size=8)
    with bf16_layers(setup.model, originals):
        scored = [forwards.window_log_probs(batch[i : i + 8], params).log_prob for i in range(0, samples, 8)]
    gap = (torch.cat(scored).double().cpu() - torch.stack([t.log_probs for t in batch]).double()).abs()
    per_step = torch.quantile(gap, torch.tensor(GAP_QUANTILES, dtype=torch.float64), dim=0)  # [Q, steps]
    return {
        "resolution": resolution,
        "samples": samples,
        "noise_level": noise_level,
        "per_step": {
            **{f"p{round(q * 100)}": per_step[k].tolist() for k, q in enumerate(GAP_QUANTILES)},
            "max": gap.max(dim=0).values.tolist(),
        },
        "all": {"mean": float(gap.mean()), "max": float(gap.max())},
        "outside_clip": {f"{eps:g}": float((gap > math.log1p(eps)).double().mean()) for eps in clips},
    }


@torch.no_grad()  # as the sampler: with autograd on, a 7B forward's saved activations filled an H100
def profile_step(setup: Setup, resolution: int, batch: int) -> dict[str, Any]:
    """Where one CFG forward of the batch spends its kernel time (``bench.kernels``)."""
    forward, _ = step_forward(setup, resolution, batch)
    return kernel_profile(forward, setup.device)


def measure_precisions(
    args: argparse.Namespace, setup: Setup, shapes: list[tuple[int, int]], report: dict[str, Any]
) -> tuple[dict[str, list[Row]], dict[str, torch.Tensor]]:
    """Each shape's row in the weights' dtype (bf16 on a GPU), in torchao's float8 if asked, then in
    ours, compiled each (unless ``--no-compile``), with its kernel profile. The model is left with
    our FP8 layers; returned with the rows: the weights those replaced."""
    device = setup.device
    rows: dict[str, list[Row]] = {args.dtype: [], **({"fp8_torchao": []} if args.torchao else {}), "fp8": []}
    if args.fast_accum:
        rows["fp8_fast"] = []
    report["rows"] = rows
    originals: dict[str, torch.Tensor] = {}
    for precision, found in rows.items():
        if args.compile and device.type == "cuda":
            uncompile_query_layers(setup.model)  # a no-op before the first
        if precision == "fp8_torchao":
            _measure_torchao(args, setup, shapes, report, found)
            continue
        if precision == "fp8":
            started = time.perf_counter()
            originals = quantize_gen_path(setup.model)
            sync(device)
            report["quantize_s"] = time.perf_counter() - started
            report["fp8_gen_path_gib"] = sum(
                m.weight.numel() for m in setup.model.modules() if isinstance(m, Fp8Linear)
            ) * E4M3.itemsize / 2**30  # fmt: skip
        if precision == "fp8_fast":  # the same FP8 weights, Hopper's fast accumulation
            set_fast_accum(setup.model, True)
        _measure_shapes(args, setup, shapes, report, precision, found)
    return rows, originals


def set_fast_accum(model: nn.Module, on: bool) -> None:
    """Every FP8 layer's :attr:`Fp8Linear.fast_accum` (``rollout.fp8_fast_accum``)."""
    for module in model.modules():
        if isinstance(module, Fp8Linear):
            module.fast_accum = on


def _measure_shapes(  # noqa: PLR0917 (what a precision's rows are measured with)
    args: argparse.Namespace,
    setup: Setup,
    shapes: list[tuple[int, int]],
    report: dict[str, Any],
    precision: str,
    found: list[Row],
) -> None:
    """The model as it is now, compiled (unless ``--no-compile``): each shape's row and profile."""
    if args.compile and setup.device.type == "cuda":
        compile_query_layers(setup.model)
    for resolution, batch in shapes:
        found.append(row := measure(setup, resolution, batch))
        print(f"{precision} {resolution}px b{batch}: {row.images_per_s:.4g} images/s", flush=True)
        if args.profile:
            kernels = report.setdefault("kernels", {}).setdefault(precision, {})
            kernels[f"{resolution}x{batch}"] = found_kernels = profile_step(setup, resolution, batch)
            print_profile(f"{precision} {resolution}px b{batch} CFG forward", found_kernels)
        write_json(args.json, report)


def _measure_torchao(
    args: argparse.Namespace,
    setup: Setup,
    shapes: list[tuple[int, int]],
    report: dict[str, Any],
    found: list[Row],
) -> None:
    """torchao's rows; a failure is reported in one line (``torchao_error``) and the run goes on
    with ours. Either way the model leaves with its unquantized layers, uncompiled."""
    kept: dict[str, torch.Tensor] = {}
    try:
        kept = fp8_torchao.quantize_gen_path_torchao(setup.model)
        _measure_shapes(args, setup, shapes, report, "fp8_torchao", found)
    except Exception as error:  # torchao's own failure: say it, measure ours regardless
        report["torchao_error"] = f"{type(error).__name__}: {' '.join(str(error).split())[:500]}"
        print(f"torchao: {report['torchao_error']}", file=sys.stderr, flush=True)
        found.clear()
        free(setup.device)
    finally:
        if args.compile and setup.device.type == "cuda":
            uncompile_query_layers(setup.model)
        fp8_torchao.restore(setup.model, kept)


def run(args: argparse.Namespace, device: torch.device) -> dict[str, Any]:
    report: dict[str, Any] = {"args": vars(args), "torch": torch.__version__, "device": device_name(device)}
    size = 8192 if device.type == "cuda" else 512
    peak = report["bf16_peak"] = MatmulPeak.measure(device)
    fp8_peak: dict[str, Figure] = {"before": fp8_matmul_tflops(device, size)}
    report["fp8_peak"] = fp8_peak
    print(f"{report['device']}: {peak.line()}; FP8 {size}^3: {fp8_peak['before']:.4g}", flush=True)
    setup = build_setup(args, device)
    shapes = parse_shapes(args.shapes)
    if args.gemms:  # the GEMMs one at a time at each shape's rows, before anything is quantized
        report["gemms"] = {}
        for resolution, batch in shapes:
            query_rows = 2 * batch * ((resolution // 16) ** 2 + 2)  # both CFG branches, the markers
            report["gemms"][f"{resolution}x{batch}"] = table = gemm_table(
                setup.model, query_rows, device, setup.repeats
            )
            print_gemms(f"{resolution}px b{batch}", table)
        write_json(args.json, report)
    rows, originals = measure_precisions(args, setup, shapes, report)
    peak.measure_after(device)
    fp8_peak["after"] = fp8_matmul_tflops(device, size)
    fp8_used = max(fig.median for fig in fp8_peak.values())
    report["fp8_images_per_s_ratio"] = {
        f"{a.resolution}x{a.batch}": ratio(b.images_per_s, a.images_per_s)
        for a, b in zip(rows[args.dtype], rows["fp8"], strict=True)
    }
    report["torchao_version"] = fp8_torchao.torchao_version() if args.torchao else None
    if args.fast_accum:  # each shape: fast accumulation over bf16's images/s
        report["fp8_fast_images_per_s_ratio"] = {
            f"{a.resolution}x{a.batch}": ratio(b.images_per_s, a.images_per_s)
            for a, b in zip(rows[args.dtype], rows["fp8_fast"], strict=True)
        }
    if args.torchao and rows["fp8_torchao"]:  # each shape: ours over torchao's images/s (> 1: ours faster)
        report["fp8_over_torchao_images_per_s"] = {
            f"{a.resolution}x{a.batch}": ratio(b.images_per_s, a.images_per_s)
            for a, b in zip(rows["fp8_torchao"], rows["fp8"], strict=True)
        }
    for measured in rows.values():
        for row in measured:
            row.mfu_loop = mfu((setup.num_points - 1) * row.step_tflop * 1e12, row.loop_s, peak.used)
    report["fp8_loop_mfu_of_fp8_peak"] = {
        f"{r.resolution}x{r.batch}": mfu((setup.num_points - 1) * r.step_tflop * 1e12, r.loop_s, fp8_used)
        for r in rows["fp8"]
    }
    if args.gap_samples:
        if args.compile and device.type == "cuda":  # the gap swaps layers: eager
            uncompile_query_layers(setup.model)
        resolution = args.gap_resolution or shapes[0][0]
        gaps = [("logp_gap", True, False), ("logp_gap_bf16", False, False)]
        for key, quantized, fast in gaps + ([("logp_gap_fast", True, True)] if args.fast_accum else []):
            set_fast_accum(setup.model, fast)
            report[key] = logp_gap(
                setup,
                originals,
                resolution=resolution,
                samples=args.gap_samples,
                noise_level=args.noise_level,
                clips=args.clip,
                quantized=quantized,
            )
    write_json(args.json, report)
    _print(report)
    return report


def _print(report: dict[str, Any]) -> None:
    print(f"bf16 matmul peak {report['bf16_peak'].used:.4g} TFLOP/s; FP8 peak "
          f"{max(f.median for f in report['fp8_peak'].values()):.4g}")  # fmt: skip
    for shape, figure in report["fp8_images_per_s_ratio"].items():
        print(f"{shape}: FP8 / {report['args']['dtype']} images/s {figure:.3f}; FP8 loop MFU of the FP8 peak "
              f"{report['fp8_loop_mfu_of_fp8_peak'][shape]:.3f}")  # fmt: skip
        if "fp8_fast_images_per_s_ratio" in report:
            print(f"  with fast accumulation: FP8 / {report['args']['dtype']} images/s "
                  f"{report['fp8_fast_images_per_s_ratio'][shape]:.3f}")  # fmt: skip
        if "fp8_over_torchao_images_per_s" in report:
            print(f"  ours / torchao {report['torchao_version']} images/s "
                  f"{report['fp8_over_torchao_images_per_s'][shape]:.3f}")  # fmt: skip
    for key, what in (("logp_gap", "FP8 samples"), ("logp_gap_fast", "FP8 samples, fast accumulation"),
                      ("logp_gap_bf16", "the control, bf16 samples")):  # fmt: skip
        if key in report:
            gap = report[key]
            print(f"log-prob gap of {what} under the bf16 recompute over {gap['samples']} samples: mean "
                  f"{gap['all']['mean']:.3g}, max {gap['all']['max']:.3g}; outside the clip: "
                  f"{gap['outside_clip']}")  # fmt: skip
            print("  per step p50:", " ".join(f"{v:.2g}" for v in gap["per_step"]["p50"]))


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="flowgrpo bench fp8", description=__doc__.split("\n\n")[0])
    p.add_argument("--model", choices=["7b", "tiny"], default="7b", help="geometry (random weights)")
    p.add_argument("--device", default="cuda")
    p.add_argument("--dtype", choices=list(DTYPES), default="bf16", help="weights (fp32: a CPU smoke)")
    p.add_argument("--shapes", default="512x8,512x32,1024x8", help="resolution x batch, comma-separated")
    p.add_argument("--repeats", type=repeats_arg, default=3)
    p.add_argument("--num-points", type=int, default=15, help="schedule points (steps + 1)")
    p.add_argument("--prompt-len", type=int, default=48)
    p.add_argument("--no-compile", dest="compile", action="store_false")
    p.add_argument("--no-profile", dest="profile", action="store_false", help="skip the kernel profiles")
    p.add_argument("--no-gemms", dest="gemms", action="store_false", help="skip the GEMM table")
    p.add_argument(
        "--torchao", action="store_true", help="also torchao's row-wise float8 on the same layers (SM 8.9+)"
    )
    p.add_argument(
        "--fast-accum",
        action="store_true",
        help="also our FP8 with Hopper's fast accumulation (rollout.fp8_fast_accum): its rows and its gap",
    )
    p.add_argument("--gap-samples", type=int, default=16, help="FP8 rollouts scored under bf16 (0: none)")
    p.add_argument(
        "--gap-resolution", type=int, default=0, help="the gap's image size (0: the first shape's)"
    )
    p.add_argument("--noise-level", type=float, default=1.3, help="the gap's SDE noise (the 7B recipes')")
    p.add_argument("--clip", type=float, nargs="+", default=[1e-5, 1e-4], help="trust regions to compare")
    p.add_argument("--json", metavar="PATH", help="write every figure as JSON (rewritten as rows come in)")
    return p


def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    device = open_device(args.device, "fp8")
    if device is None:
        return 2
    if args.torchao and (refused := fp8_torchao.refusal(device, args.dtype)):
        print(f"bench fp8 --torchao: {refused}", file=sys.stderr)
        return 2
    torch.backends.cudnn.benchmark = True
    run(args, device)
    return 0
