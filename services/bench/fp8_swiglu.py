"""EXPERIMENT (bench only: ``bench fp8 --fused-swiglu``): the FP8 down projection's input, the
SwiGLU's ``silu(gate) * up``, quantized row-wise in one pass over each row.

Why: on an H100 at 512 px b8 the kernel Inductor fuses for the SwiGLU with the down projection's
quantization takes 32.3 ms of a 240 ms FP8 forward, against 16.9 ms for bf16's SwiGLU alone
(docs/fp8.md): its row amax is a looped reduction over the 18,944 values of a row, and the cast
reads the row again. Here one program holds a whole row in registers: gate and up are read once,
the e4m3 values and the row's scale written once.

The arithmetic is :func:`flowgrpo.models.bagel.fp8.quantize_rowwise` of ``silu(gate) * up``
computed in fp32 (as Inductor computes the fused SwiGLU: no bf16 rounding in between), the
divisions rounded to nearest (``div_rn``) as PyTorch's are. :func:`reference` is the same in
PyTorch; tests/bench/test_fp8_swiglu_gpu.py holds the kernel to it on a GPU.

:func:`fuse` patches every decoder layer's quantized gen-path SwiGLU to use it (the weights stay
where they are: names, updates and the shared base are untouched); what it returns undoes it.
Triton is imported only when the kernel runs: a CPU install has none.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from flowgrpo.models.bagel.fp8 import AMAX_FLOOR, E4M3, E4M3_MAX, INV_E4M3_MAX, Fp8Linear, quantize_rowwise
from flowgrpo.models.bagel.model import SwiGLU


def reference(gate: Tensor, up: Tensor) -> tuple[Tensor, Tensor]:
    """(e4m3 values [R, H], fp32 scales [R, 1]) of ``silu(gate) * up`` in fp32, row-wise."""
    return quantize_rowwise(F.silu(gate.float()) * up.float())


@functools.cache
def _kernel() -> Any:
    import triton
    import triton.language as tl

    @triton.autotune(  # type: ignore[untyped-decorator]
        configs=[triton.Config({}, num_warps=w) for w in (8, 16, 32)],
        key=["cols"],
    )
    @triton.jit  # type: ignore[untyped-decorator]
    def swiglu_quantize_rowwise(  # type: ignore[no-untyped-def]  # noqa: PLR0917 (annotations are Triton's)
        gate_ptr,
        up_ptr,
        out_ptr,
        scale_ptr,
        cols,
        gate_stride,
        up_stride,
        out_stride,
        BLOCK: tl.constexpr,
        FLOOR: tl.constexpr,
        INV_MAX: tl.constexpr,
        MAX: tl.constexpr,
    ):
        row = tl.program_id(0).to(tl.int64)
        offsets = tl.arange(0, BLOCK)
        inside = offsets < cols
        gate = tl.load(gate_ptr + row * gate_stride + offsets, mask=inside, other=0.0).to(tl.float32)
        up = tl.load(up_ptr + row * up_stride + offsets, mask=inside, other=0.0).to(tl.float32)
        product = tl.math.div_rn(gate, 1.0 + tl.exp(-gate)) * up  # silu(gate) * up; 0 outside the row
        scale = tl.maximum(tl.max(tl.abs(product), axis=0), FLOOR) * INV_MAX
        values = tl.clamp(tl.math.div_rn(product, scale), -MAX, MAX)
        tl.store(out_ptr + row * out_stride + offsets, values.to(tl.float8e4nv), mask=inside)
        tl.store(scale_ptr + row, scale)

    return swiglu_quantize_rowwise


@torch.library.triton_op("flowgrpo::swiglu_quantize_rowwise", mutates_args={})
def swiglu_quantize_rowwise(gate: Tensor, up: Tensor) -> tuple[Tensor, Tensor]:
    """The kernel's (values, scales) of gate, up [R, H] (rows contiguous), as :func:`reference`."""
    from torch.library import wrap_triton

    rows, cols = gate.shape
    values = torch.empty(rows, cols, dtype=E4M3, device=gate.device)
    scales = torch.empty(rows, 1, dtype=torch.float32, device=gate.device)
    block = 1 << (cols - 1).bit_length()  # the whole row in one program
    wrap_triton(_kernel())[(rows,)](
        gate,
        up,
        values,
        scales,
        cols,
        gate.stride(0),
        up.stride(0),
        values.stride(0),
        BLOCK=block,
        FLOOR=AMAX_FLOOR,
        INV_MAX=INV_E4M3_MAX,
        MAX=E4M3_MAX,
    )
    return values, scales


def _fused_forward(mlp: SwiGLU) -> Callable[[Tensor], Tensor]:
    gate_proj, up_proj, down = mlp.gate_proj, mlp.up_proj, mlp.down_proj
    assert isinstance(down, Fp8Linear)

    def forward(x: Tensor) -> Tensor:
        gate, up = gate_proj(x), up_proj(x)
        if gate.numel() == 0:  # no gen-path token in this forward (a prompt's prefill)
            return gate.new_empty(*x.shape[:-1], down.out_features)
        values, scales = swiglu_quantize_rowwise(gate.flatten(0, -2), up.flatten(0, -2))
        y = torch._scaled_mm(
            values,
            down.weight.t(),
            scale_a=scales,
            scale_b=down.weight_scale.t(),
            out_dtype=gate.dtype,
            use_fast_accum=down.fast_accum,
        )
        return y.unflatten(0, x.shape[:-1])

    return forward


def fuse(model: nn.Module) -> Callable[[], None]:
    """Every gen-path SwiGLU whose three layers are FP8 (``quantize_gen_path``) computes its down
    projection's input with the kernel; returns what undoes it. Refuses a model without one."""
    patched = [
        m
        for name, m in model.named_modules()
        if isinstance(m, SwiGLU)
        and name.endswith("mlp_moe_gen")
        and all(isinstance(layer, Fp8Linear) for layer in (m.gate_proj, m.up_proj, m.down_proj))
    ]
    if not patched:
        raise ValueError("no FP8 gen-path SwiGLU to fuse: quantize_gen_path first")
    for mlp in patched:
        vars(mlp)["forward"] = _fused_forward(mlp)

    def undo() -> None:
        for mlp in patched:
            vars(mlp).pop("forward", None)

    return undo


__all__ = ["fuse", "reference", "swiglu_quantize_rowwise"]
