"""FP8 linear layers for the rollout (``rollout.precision=fp8``), applied from outside the model as
``parallelize.py`` applies compile: :func:`quantize_gen_path` swaps the gen path's linear layers of
every decoder layer (q/k/v/o and the SwiGLU of the ``moe_gen`` expert: the denoising loop's
matmuls) for :class:`Fp8Linear`. Attention, norms, the und path (the prompt's prefill, once per
request), the timestep embedder, the heads and the VAE stay in the weights' dtype.

The arithmetic, e4m3 with row-wise scales (one per row of the activation, one per output channel
of the weight), what Hopper's FP8 tensor cores take through ``torch._scaled_mm``:

- scale(row) = max(|row|, AMAX_FLOOR) x fp32(1 / E4M3_MAX), in fp32;
- q(row) = cast_e4m3(clamp(row / scale, -E4M3_MAX, E4M3_MAX)) (round to nearest even);
- y = (q(x) scale_x) (q(W) scale_W)^T + b, accumulated in fp32, written in the output dtype.

The same call runs on a CPU (PyTorch's reference kernel: the operands cast back to fp32 with the
same scales, then an fp32 matmul), so CI checks the numbers the GPU computes, within the GPU's
accumulation order. The weight is quantized once per version: at load, and by the rollout's
policy applier after every update (the LoRA merged onto the base in fp32, then quantized:
:meth:`Fp8Linear.set_weight`). The activation is quantized in the forward, inside the query path's
per-layer halves the rollout compiles, where inductor can fuse the amax, scale and cast with
the work before the GEMM (an eager quantization costs about as much as the GEMM).
"""

from __future__ import annotations

import torch
from torch import Tensor, nn

from flowgrpo.models.bagel.config import GEN_PATH_LINEARS

E4M3 = torch.float8_e4m3fn
E4M3_MAX = 448.0  # torch.finfo(torch.float8_e4m3fn).max
AMAX_FLOOR = 1e-12  # an all-zero row: scale AMAX_FLOOR / 448, its values stay 0
# a multiplication, not a division by 448: PyTorch's CUDA kernels divide by a scalar as a
# multiplication by its reciprocal, so this is the form both devices round alike (with a division
# an H100's quantization was not bitwise the CPU's; with this it is on an H200, test_fp8_gpu.py)
INV_E4M3_MAX = 1.0 / E4M3_MAX
FP8_CAPABILITY = (8, 9)  # Ada and Hopper: the first with FP8 tensor cores


def rowwise_scales(t: Tensor) -> Tensor:
    """One fp32 scale per row of a 2-D tensor, [rows, 1]: the row's amax over E4M3_MAX."""
    return t.abs().amax(dim=-1, keepdim=True).float().clamp(min=AMAX_FLOOR) * INV_E4M3_MAX


def quantize_rowwise(t: Tensor) -> tuple[Tensor, Tensor]:
    """(e4m3 values, fp32 scales [rows, 1]) of a 2-D tensor: t ~ values * scales."""
    scales = rowwise_scales(t)
    values = (t.float() / scales).clamp(-E4M3_MAX, E4M3_MAX).to(E4M3)
    return values, scales


def fp8_matmul(
    x: Tensor,
    weight: Tensor,
    weight_scale: Tensor,
    out_dtype: torch.dtype,
    *,
    bias: Tensor | None = None,
    fast_accum: bool = False,
) -> Tensor:
    """x [..., in] times the quantized weight [out, in] (scales [out, 1]), plus ``bias`` ->
    [..., out]. The bias is added in the GEMM's epilogue, in fp32 before the output's rounding,
    where the output is not fp32 (cuBLAS takes no bias then) and the accumulation is not fast.
    ``fast_accum``: Hopper's fast FP8 accumulation (no periodic promotion of the partial sums to
    fp32: faster, less exact; what torchao's float8 inference uses by default); the CPU's
    reference kernel ignores it."""
    if x.numel() == 0:  # an expert with no token in this forward (the prefill's text-only one)
        return x.new_empty(*x.shape[:-1], weight.shape[0], dtype=out_dtype)
    rows = x.reshape(-1, x.shape[-1]).contiguous()  # row-major, as _scaled_mm takes it (x may be expanded)
    values, scales = quantize_rowwise(rows)
    y = _scaled_rows_mm(values, scales, weight, weight_scale, out_dtype, bias=bias, fast_accum=fast_accum)
    return y.reshape(*x.shape[:-1], weight.shape[0])


def _scaled_rows_mm(
    values: Tensor,
    scales: Tensor,
    weight: Tensor,
    weight_scale: Tensor,
    out_dtype: torch.dtype,
    *,
    bias: Tensor | None,
    fast_accum: bool,
) -> Tensor:
    """The GEMM of :func:`fp8_matmul` on rows already quantized (``values`` [rows, in] e4m3,
    ``scales`` [rows, 1]) -> [rows, out]."""
    # cuBLAS has no kernel for some shapes of bias and fast accumulation together (an H100 at
    # 256 x 18944 x 384); each alone had one at every shape tried
    fused = bias is not None and out_dtype != torch.float32 and not fast_accum
    y = torch._scaled_mm(
        values,
        weight.t(),
        scale_a=scales,
        scale_b=weight_scale.t(),
        bias=bias.to(out_dtype) if fused and bias is not None else None,
        out_dtype=out_dtype,
        use_fast_accum=fast_accum,
    )
    if bias is not None and not fused:
        y = y + bias.to(out_dtype)
    return y


class Fp8Linear(nn.Module):
    """A linear layer whose weight is held in e4m3 with a scale per output channel; the bias (if
    any) in the dtype the layer had. ``weight`` keeps its name and shape, so updates, the shared
    base and checkpoint names find it as they find an ``nn.Linear``'s; write it with
    :meth:`set_weight`, never in place (a plain copy would drop the scales). ``fast_accum``:
    :func:`fp8_matmul`'s (``rollout.fp8_fast_accum``)."""

    def __init__(
        self,
        in_features: int,
        out_features: int,
        bias: Tensor | None,
        device: torch.device,
        fast_accum: bool = False,
    ) -> None:
        super().__init__()
        self.in_features, self.out_features = in_features, out_features
        self.fast_accum = fast_accum
        self.weight = nn.Parameter(torch.empty(out_features, in_features, dtype=E4M3, device=device), False)
        self.register_buffer("weight_scale", torch.ones(out_features, 1, device=device))
        self.bias = None if bias is None else nn.Parameter(bias.detach(), requires_grad=False)

    @classmethod
    def from_linear(cls, linear: nn.Linear, fast_accum: bool = False) -> Fp8Linear:
        layer = cls(linear.in_features, linear.out_features, linear.bias, linear.weight.device, fast_accum)
        if not linear.weight.is_meta:
            layer.set_weight(linear.weight)
        return layer

    @torch.no_grad()
    def set_weight(self, weight: Tensor) -> None:
        """Quantize ``weight`` [out, in] (any float dtype; e.g. the LoRA merged in fp32) into this
        layer; on the meta device (a model waiting for a shared base) the layer takes new storage."""
        if self.weight.is_meta:  # the weight's device: a mapped base's, or the checkpoint's
            values, scales = quantize_rowwise(weight)
            self.weight = nn.Parameter(values, requires_grad=False)
            self.weight_scale = scales
        else:
            values, scales = quantize_rowwise(weight.to(self.weight.device))
            self.weight.copy_(values)
            self.weight_scale.copy_(scales)

    def forward(self, x: Tensor) -> Tensor:
        out_dtype = x.dtype
        if x.is_cuda and torch.is_autocast_enabled("cuda"):  # as nn.Linear answers under autocast
            out_dtype = torch.get_autocast_dtype("cuda")
        return fp8_matmul(
            x, self.weight, self.weight_scale, out_dtype, bias=self.bias, fast_accum=self.fast_accum
        )

    def extra_repr(self) -> str:
        fast = ", fast accumulation" if self.fast_accum else ""
        return f"in_features={self.in_features}, out_features={self.out_features}, e4m3 row-wise{fast}"


class _FrozenFp8Matmul(torch.autograd.Function):
    """x W^T for a frozen W (a LoRA's base) with both GEMMs in FP8: the forward's on x already
    quantized per row (``x_values``, ``x_scales``: x itself is here only for the graph, its
    gradient and its dtype), and the input's gradient g W from g quantized per row and W per
    input channel (the rows of W^T); no weight gradient and nothing of x kept for one."""

    @staticmethod
    def forward(  # noqa: PLR0917 (autograd passes what apply is given)
        ctx: torch.autograd.function.FunctionCtx,
        x: Tensor,
        x_values: Tensor,
        x_scales: Tensor,
        weight_q: Tensor,
        weight_scale: Tensor,
        weight_t_q: Tensor,
        weight_t_scale: Tensor,
        out_dtype: torch.dtype,
        fast_accum: bool,
    ) -> Tensor:
        ctx.save_for_backward(weight_t_q, weight_t_scale)
        ctx.x_dtype = x.dtype  # type: ignore[attr-defined]
        y = _scaled_rows_mm(
            x_values, x_scales, weight_q, weight_scale, out_dtype, bias=None, fast_accum=fast_accum
        )
        return y.reshape(*x.shape[:-1], weight_q.shape[0])

    @staticmethod
    def backward(ctx: torch.autograd.function.FunctionCtx, grad: Tensor) -> tuple[Tensor | None, ...]:
        weight_t_q, weight_t_scale = ctx.saved_tensors  # type: ignore[attr-defined]
        # contiguous(): a no-op in eager; compiled, Inductor otherwise laid the saved weight's
        # transpose out row-major, which _scaled_mm refuses (seen on a CPU, torch 2.13)
        grad_x = fp8_matmul(grad, weight_t_q.contiguous(), weight_t_scale, grad.dtype)  # exact accumulation
        return (grad_x.to(ctx.x_dtype),) + (None,) * 8  # type: ignore[attr-defined]


class Fp8FrozenLinear(nn.Module):
    """A frozen linear layer that trains what is around it in FP8 (EXPERIMENT, `bench trainer`'s
    '-fp8' variants: the LoRA trainer's base matmuls on FP8 tensor cores): the forward and the
    input's gradient each an e4m3 GEMM with row-wise scales (:class:`_FrozenFp8Matmul`), the
    weight held twice in e4m3 (per output channel for the forward, per input channel for the
    gradient: 2 bytes a weight against bf16's 2, quantized once: the base never changes), the
    bias in the layer's dtype."""

    def __init__(self, linear: nn.Linear, fast_accum: bool = False) -> None:
        super().__init__()
        self.in_features, self.out_features = linear.in_features, linear.out_features
        self.fast_accum = fast_accum
        with torch.no_grad():
            weight_q, weight_scale = quantize_rowwise(linear.weight)
            weight_t_q, weight_t_scale = quantize_rowwise(linear.weight.t())
        self.register_buffer("weight_q", weight_q)
        self.register_buffer("weight_scale", weight_scale)
        self.register_buffer("weight_t_q", weight_t_q)
        self.register_buffer("weight_t_scale", weight_t_scale)
        self.bias = None if linear.bias is None else linear.bias.detach()

    def forward(self, x: Tensor) -> Tensor:
        out_dtype = x.dtype
        if x.is_cuda and torch.is_autocast_enabled("cuda"):
            out_dtype = torch.get_autocast_dtype("cuda")
        if x.numel() == 0:  # an expert with no token in this forward
            return x.new_empty(*x.shape[:-1], self.out_features, dtype=out_dtype)
        # the input quantized here, outside the autograd function: compiled with dynamic shapes,
        # Dynamo could not trace it inside the function's forward where two frozen layers read one
        # input (q, k and v; "lift_tracked_freevar_to_input should not be called on root
        # SubgraphTracer", an H100, torch 2.11)
        x_values, x_scales = quantize_rowwise(x.detach().reshape(-1, x.shape[-1]).contiguous())
        weights = (self.weight_q, self.weight_scale, self.weight_t_q, self.weight_t_scale)
        y: Tensor = _FrozenFp8Matmul.apply(  # type: ignore[no-untyped-call]
            x, x_values, x_scales, *weights, out_dtype, self.fast_accum
        )
        return y if self.bias is None else y + self.bias.to(out_dtype)

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, frozen, e4m3 GEMMs"


def gen_path_linears(model: nn.Module) -> dict[str, nn.Linear]:
    """The decoder layers' gen-path linear layers (``GEN_PATH_LINEARS``) by module name: the
    layers FP8 rollouts quantize (:func:`quantize_gen_path`; torchao's in ``bench fp8 --torchao``)."""
    return {
        name: module
        for name, module in model.named_modules()
        if isinstance(module, nn.Linear) and name.endswith(GEN_PATH_LINEARS)
    }


def quantize_gen_path(model: nn.Module, fast_accum: bool = False) -> dict[str, Tensor]:
    """Swap every decoder layer's gen-path linear layers (:func:`gen_path_linears`) for
    :class:`Fp8Linear`, in place. Returns the weights they held, by module name (the merge base of
    a LoRA policy: every version is merged onto these, then quantized); empty for a model on the
    meta device."""
    originals: dict[str, Tensor] = {}
    for name, module in gen_path_linears(model).items():
        if not module.weight.is_meta:
            originals[name] = module.weight.detach()
        parent_name, _, child = name.rpartition(".")
        setattr(model.get_submodule(parent_name), child, Fp8Linear.from_linear(module, fast_accum))
    if not originals and not any(isinstance(m, Fp8Linear) for m in model.modules()):
        raise ValueError("rollout.precision=fp8 found no gen-path linear layer to quantize in this model")
    return originals


def check_fp8_device(device: str | torch.device) -> None:
    """Refuse a GPU without FP8 tensor cores, in one line naming it; a CPU runs the reference
    kernel (the tests' emulation)."""
    device = torch.device(device)
    if device.type != "cuda":
        return
    capability = torch.cuda.get_device_capability(device)
    if capability < FP8_CAPABILITY:
        name = torch.cuda.get_device_name(device)
        raise RuntimeError(
            f"rollout.precision=fp8 needs FP8 tensor cores (compute capability "
            f"{FP8_CAPABILITY[0]}.{FP8_CAPABILITY[1]}+: Ada, Hopper); {device} is a {name} "
            f"({capability[0]}.{capability[1]}): use rollout.precision=dtype"
        )
