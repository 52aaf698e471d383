"""Where a forward's GPU time goes: ``torch.profiler`` over a few calls, the device time per
kernel summed by kind (GEMM, attention, the fused kernels ``torch.compile`` generated, the rest),
and the kernels that took the most, by name. On a CPU the same is taken over the ATen operators'
own CPU time (a smoke: the kinds mean little there).

The kinds come from kernel names (cuBLAS's ``nvjet_*``, ``*gemm*``, CUTLASS's ``sm90_xmma_*``;
FlashAttention's and cuDNN's ``*flash*``/``*fmha*``; Inductor's ``triton_*``; the optimizer's
``multi_tensor_apply``/foreach kernels; NCCL's): a name of another library lands in ``other``,
which is why the top kernels are reported by name beside them.
"""

from __future__ import annotations

import re
import time
from collections.abc import Callable
from typing import Any

import torch
from torch._C._autograd import DeviceType
from torch.profiler import ProfilerActivity, profile

KINDS = (  # the first pattern a kernel's name matches gives its kind
    # Inductor's fused kernels first: their names list the ops they feed, so the activation's
    # quantization before an FP8 GEMM reads "triton_red_fused__scaled_mm_..._amax_..."; its GEMM
    # templates ("triton_tem_...") are GEMMs
    ("compiled (fused)", re.compile(r"^triton_(?!tem_)", re.I)),
    (
        "gemm",
        re.compile(r"gemm|nvjet|xmma|cutlass|_scaled_mm|^triton_tem_|aten::(mm|addmm|bmm|matmul)$", re.I),
    ),
    ("attention", re.compile(r"flash|fmha|attention|sdpa", re.I)),
    ("optimizer", re.compile(r"multi_tensor|foreach|adam", re.I)),  # AdamW's fused/foreach kernels
    ("communication", re.compile(r"nccl", re.I)),  # FSDP's all-gathers and reduce-scatters
)
TOP = 12


def kind_of(name: str) -> str:
    return next((kind for kind, pattern in KINDS if pattern.search(name)), "other")


def kernel_profile(fn: Callable[[], object], device: torch.device, calls: int = 3) -> dict[str, Any]:
    """Profile ``calls`` calls of ``fn`` (after one unprofiled call): per kind its device time per
    call (ms) and share, and the ``TOP`` kernels by time (name, ms per call, launches per call)."""
    fn()
    on_gpu = device.type == "cuda"
    activities = [ProfilerActivity.CUDA] if on_gpu else [ProfilerActivity.CPU]
    if on_gpu:
        torch.cuda.synchronize(device)
    with profile(activities=activities) as prof:
        started = time.perf_counter()
        for _ in range(calls):
            fn()
        if on_gpu:
            torch.cuda.synchronize(device)
        wall_s = time.perf_counter() - started
    kernels: dict[str, tuple[float, int]] = {}  # name -> (microseconds, launches) over the calls
    for event in prof.key_averages():
        if on_gpu:
            if event.device_type != DeviceType.CUDA:
                continue
            micros = event.self_device_time_total
        else:
            if not event.key.startswith("aten::"):
                continue
            micros = event.self_cpu_time_total
        if micros > 0:
            before = kernels.get(event.key, (0.0, 0))
            kernels[event.key] = (before[0] + micros, before[1] + event.count)
    # the profiled calls' own wall time: what the kernels' time is inside (a profiled call is
    # slower than an unprofiled one, on a CPU by much: each op's record costs microseconds)
    return summarize(kernels, calls) | {"wall_ms_per_call": wall_s * 1e3 / calls}


def summarize(kernels: dict[str, tuple[float, int]], calls: int) -> dict[str, Any]:
    """Kernel times (microseconds and launches over ``calls`` calls) as the report's figures."""
    total = sum(micros for micros, _ in kernels.values())
    by_kind: dict[str, float] = {kind: 0.0 for kind, _ in KINDS} | {"other": 0.0}
    for name, (micros, _) in kernels.items():
        by_kind[kind_of(name)] += micros
    top = sorted(kernels.items(), key=lambda item: -item[1][0])[:TOP]
    return {
        "calls": calls,
        "ms_per_call": total / 1e3 / calls,
        "kinds": {
            kind: {"ms_per_call": micros / 1e3 / calls, "share": micros / total if total else 0.0}
            for kind, micros in by_kind.items()
        },
        "top": [
            {
                "name": name,
                "kind": kind_of(name),
                "ms_per_call": micros / 1e3 / calls,
                "launches": count / calls,
            }
            for name, (micros, count) in top
        ],
    }


def print_profile(title: str, report: dict[str, Any]) -> None:
    kinds = ", ".join(f"{k} {v['ms_per_call']:.3g} ms ({v['share']:.0%})" for k, v in report["kinds"].items())
    print(f"{title}: {report['ms_per_call']:.4g} ms of kernels a call: {kinds}", flush=True)
    for kernel in report["top"][:6]:
        name = kernel["name"][:90]
        print(f"  {kernel['ms_per_call']:8.3f} ms x{kernel['launches']:g}  {kernel['kind']:<16} {name}")
