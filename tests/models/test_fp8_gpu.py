"""FP8 rollouts on a CUDA device (Hopper's FP8 tensor cores through ``torch._scaled_mm``): the
quantization bitwise equal to the CPU's, the GEMM against the float64 product of the dequantized
operands, the compiled query path against eager, and an FP8 model against its bf16 self.
GPU-only: run by bench/gpu_check.sh, never in CI (tests/models/test_fp8.py: the same on a CPU)."""

from __future__ import annotations

import pytest
import torch

from flowgrpo.models.bagel.attention import KVCache
from flowgrpo.models.bagel.config import tiny
from flowgrpo.models.bagel.fp8 import (
    Fp8FrozenLinear,
    Fp8Linear,
    check_fp8_device,
    fp8_matmul,
    quantize_gen_path,
    quantize_rowwise,
)
from flowgrpo.models.bagel.model import BagelModel, latent_position_ids
from flowgrpo.models.bagel.parallelize import compile_query_layers

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]
MARKERS = {"soi_id": 386, "eoi_id": 387}


def rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a.double() - b.double()).norm() / b.double().norm())


def test_the_quantization_is_the_cpus_and_the_gemm_the_dequantized_product() -> None:
    check_fp8_device("cuda")  # an H100 / H200 has FP8 tensor cores
    g = torch.Generator().manual_seed(0)
    x, w = torch.randn(300, 256, generator=g), torch.randn(512, 256, generator=g) * 0.02
    xq, xs = quantize_rowwise(x)
    wq, ws = quantize_rowwise(w)
    on_gpu = (*quantize_rowwise(x.cuda()), *quantize_rowwise(w.cuda()))
    for name, cpu, gpu in zip(("x", "x scales", "w", "w scales"), (xq, xs, wq, ws), on_gpu, strict=True):
        differ = int((cpu.float() != gpu.cpu().float()).sum())  # the same fp32 arithmetic and rounding
        assert differ == 0, f"{name}: {differ} of {cpu.numel()} differ between the CPU and the GPU"
    y = fp8_matmul(x.cuda().bfloat16(), wq.cuda(), ws.cuda(), torch.bfloat16)
    xq16, xs16 = quantize_rowwise(x.bfloat16())  # what the GPU quantized: the bf16 activation
    expected = (xq16.double() * xs16.double()) @ (wq.double() * ws.double()).t()
    assert rel_err(y.cpu(), expected) < 4e-3  # bf16 output rounding (2^-9) over fp32 accumulation


def test_the_bias_in_the_epilogue_and_the_fast_accumulation_stay_near_the_product() -> None:
    """cuBLAS adds the bias before the output's rounding; Hopper's fast accumulation
    (rollout.fp8_fast_accum) keeps its partial sums in the tensor cores' lower precision: at the
    7B's longest reduction (18,944, the down projection) both stay near the float64 product."""
    g = torch.Generator().manual_seed(2)
    x, w = torch.randn(256, 18944, generator=g), torch.randn(384, 18944, generator=g) * 0.01
    bias = torch.randn(384, generator=g)
    wq, ws = quantize_rowwise(w)
    xq, xs = quantize_rowwise(x.bfloat16())
    expected = (xq.double() * xs.double()) @ (wq.double() * ws.double()).t() + bias.bfloat16().double()
    operands = (x.cuda().bfloat16(), wq.cuda(), ws.cuda(), torch.bfloat16)
    exact = fp8_matmul(*operands, bias=bias.cuda())
    # this shape has no cuBLAS kernel for the bias in the epilogue with fast accumulation: added after
    fast = fp8_matmul(*operands, bias=bias.cuda(), fast_accum=True)
    assert rel_err(exact.cpu(), expected) < 4e-3  # one bf16 rounding over fp32 accumulation
    assert rel_err(fast.cpu(), expected) < 5e-2, rel_err(fast.cpu(), expected)  # DeepSeek-V3: ~14 bits kept


def test_a_frozen_fp8_layer_trains_its_input_compiled_as_eager_near_the_float64_product() -> None:
    """The '-fp8' trainer experiment's layer (Fp8FrozenLinear) on Hopper under bf16 autocast, at a
    gen-path shape (3584 -> 18944 and back): the input's gradient near the float64 product of
    the quantized operands, compiled as eager (the trainer compiles its query path)."""
    g = torch.Generator().manual_seed(4)
    linear = torch.nn.Linear(3584, 18944, bias=False).requires_grad_(False)
    with torch.no_grad():
        linear.weight.copy_(torch.randn(18944, 3584, generator=g) * 0.01)
    layer = Fp8FrozenLinear(linear.cuda().bfloat16())
    x = torch.randn(512, 3584, generator=g)
    grad = torch.randn(512, 18944, generator=g)

    def input_grad(forward: torch.nn.Module) -> torch.Tensor:
        inputs = x.cuda().bfloat16().requires_grad_(True)
        with torch.autocast("cuda", dtype=torch.bfloat16):
            forward(inputs).backward(grad.cuda().bfloat16())
        assert inputs.grad is not None
        return inputs.grad

    eager = input_grad(layer)
    gq, gs = quantize_rowwise(grad.bfloat16())
    wq, ws = quantize_rowwise(linear.weight.t().cpu().bfloat16())
    expected = (gq.double() * gs.double()) @ (wq.double() * ws.double()).t()
    assert rel_err(eager.cpu(), expected) < 4e-3  # bf16 output rounding over fp32 accumulation
    # with dynamic shapes and in one graph, as the trainer compiles its query path
    compiled = input_grad(torch.compile(layer, dynamic=True, fullgraph=True))
    assert rel_err(compiled.cpu(), eager.cpu()) < 1e-2


@torch.no_grad()
def test_an_fp8_model_compiles_and_stays_near_its_bf16_self() -> None:
    torch.manual_seed(1)
    bf16 = BagelModel(tiny()).cuda().to(torch.bfloat16).eval()
    fp8 = BagelModel(tiny()).cuda().to(torch.bfloat16).eval()
    fp8.load_state_dict(bf16.state_dict())
    quantize_gen_path(fp8)
    assert sum(isinstance(m, Fp8Linear) for m in fp8.modules()) == 7 * tiny().layers
    ids = torch.randint(1, 380, (2, 9), device="cuda")
    mask = torch.ones(2, 9, dtype=torch.bool, device="cuda")
    x = torch.randn(4, 20, 64, device="cuda")
    t = torch.tensor([1.0, 0.5, 1.0, 0.5], device="cuda")
    pos = latent_position_ids(4, 5, tiny().max_latent_size, "cuda")

    def velocity(model: BagelModel) -> torch.Tensor:
        with torch.autocast("cuda", dtype=torch.bfloat16):  # as the sampler runs both
            empty = KVCache.empty(model.config, 2, torch.bfloat16, "cuda")
            cache = KVCache.cat_rows([model.prefill(ids, mask), empty])
            return model.predict_velocity(cache, x, t, pos, **MARKERS)

    reference, eager = velocity(bf16), velocity(fp8)
    assert 1e-3 < rel_err(eager, reference) < 6e-2  # FP8's error: present, and a few percent
    compile_query_layers(fp8)
    compiled = velocity(fp8)
    # fused quantization, the same GEMMs: a bf16 rounding of an activation that differs (fused
    # elementwise work, 1e-2 in bf16 alone: test_bagel_gpu.py) can move it to the next e4m3 level
    assert rel_err(compiled, eager) < 3e-2
