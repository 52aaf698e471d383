"""The one-pass SwiGLU quantization kernel of ``bench fp8 --fused-swiglu`` (an experiment,
services/bench/fp8_swiglu.py) on a CUDA device with FP8: the kernel against its PyTorch
reference, and a model whose SwiGLUs use it against the same FP8 model without, eager and
compiled. GPU-only: run by bench/gpu_check.sh, never in CI (a CPU install has no Triton)."""

from __future__ import annotations

import importlib.util

import pytest
import torch

from flowgrpo.models.bagel.attention import KVCache
from flowgrpo.models.bagel.config import tiny
from flowgrpo.models.bagel.fp8 import E4M3_MAX, quantize_gen_path
from flowgrpo.models.bagel.model import BagelModel, latent_position_ids
from flowgrpo.models.bagel.parallelize import compile_query_layers, uncompile_query_layers

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(
        not torch.cuda.is_available() or torch.cuda.get_device_capability() < (8, 9),
        reason="needs a CUDA device with FP8 (compute capability 8.9+)",
    ),
    pytest.mark.skipif(importlib.util.find_spec("triton") is None, reason="needs Triton"),
]
MARKERS = {"soi_id": 386, "eoi_id": 387}


def rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a.double() - b.double()).norm() / b.double().norm())


@pytest.mark.parametrize("cols", [18944, 700, 128])  # the 7B's row, an odd one, the tiny model's
def test_the_kernel_quantizes_as_its_reference(cols: int) -> None:
    """Scales within fp32 rounding of the reference's (the kernel's exp is not PyTorch's to the
    last bit); values the same e4m3 level, or the next one where the two fp32 products straddle a
    rounding boundary (a handful)."""
    from flowgrpo.services.bench.fp8_swiglu import reference, swiglu_quantize_rowwise

    g = torch.Generator(device="cuda").manual_seed(cols)
    gate = (torch.randn(257, cols, device="cuda", generator=g) * 3).bfloat16()
    up = torch.randn(257, cols, device="cuda", generator=g).bfloat16()
    up[7] = 0  # an all-zero row: the floor's scale, values 0
    values, scales = swiglu_quantize_rowwise(gate, up)
    want_values, want_scales = reference(gate, up)
    assert values.dtype == want_values.dtype and scales.shape == want_scales.shape == (257, 1)
    assert torch.allclose(scales, want_scales, rtol=1e-6, atol=0)
    assert torch.equal(values[7].float(), torch.zeros(cols, device="cuda"))
    got, want = values.float(), want_values.float()
    assert float(got.abs().max()) == E4M3_MAX  # every row's amax maps to 448
    differ = got != want
    assert int(differ.sum()) <= max(8, got.numel() // 10_000), int(differ.sum())
    step = torch.maximum(want.abs() / 8, torch.full_like(want, 2**-9))  # one e4m3 level (subnormal: 2^-9)
    assert bool((got - want)[differ].abs().le(step[differ] * 1.01).all())


@torch.no_grad()
def test_a_fused_model_computes_what_the_fp8_model_does_eager_and_compiled() -> None:
    from flowgrpo.services.bench.fp8_swiglu import fuse

    torch.manual_seed(3)
    model = BagelModel(tiny()).cuda().to(torch.bfloat16).eval()
    quantize_gen_path(model, fast_accum=True)
    ids = torch.randint(1, 380, (2, 9), device="cuda")
    mask = torch.ones(2, 9, dtype=torch.bool, device="cuda")
    x = torch.randn(4, 20, 64, device="cuda")
    t = torch.tensor([1.0, 0.5, 1.0, 0.5], device="cuda")
    pos = latent_position_ids(4, 5, tiny().max_latent_size, "cuda")

    def velocity() -> torch.Tensor:
        with torch.autocast("cuda", dtype=torch.bfloat16):  # as the sampler runs
            empty = KVCache.empty(model.config, 2, torch.bfloat16, "cuda")
            cache = KVCache.cat_rows([model.prefill(ids, mask), empty])
            return model.predict_velocity(cache, x, t, pos, **MARKERS)

    plain = velocity()
    undo = fuse(model)
    fused = velocity()
    # the same quantization but for the bf16 rounding of silu(gate) * up, which the kernel skips
    assert rel_err(fused, plain) < 3e-2
    compile_query_layers(model)
    compiled = velocity()
    assert rel_err(compiled, fused) < 3e-2
    uncompile_query_layers(model)
    undo()
    assert torch.equal(velocity(), plain)  # undone: the model's own SwiGLU again
    with pytest.raises(ValueError, match="no FP8 gen-path SwiGLU"):
        fuse(BagelModel(tiny()))
