"""FP8 rollouts (models/bagel/fp8.py): the quantization against a float64 reference of its rule
written out here, the GEMM against float64 matmuls of the dequantized operands, the layer swap,
LoRA merged then quantized, and the trainer's shared base quantized into the rollout's own copy.
On a CPU ``torch._scaled_mm`` is PyTorch's reference kernel: these are the numbers the GPU's
FP8 tensor cores compute, within fp32 accumulation order (tests/models/test_bagel_gpu.py runs the
same checks on CUDA)."""

from __future__ import annotations

import math
from pathlib import Path

import pytest
import torch
from torch import nn

from flowgrpo.models.bagel.config import GEN_PATH_LINEARS, SpecialTokens, tiny
from flowgrpo.models.bagel.fp8 import (
    E4M3_MAX,
    Fp8FrozenLinear,
    Fp8Linear,
    check_fp8_device,
    fp8_matmul,
    quantize_gen_path,
    quantize_rowwise,
)
from flowgrpo.models.bagel.model import BagelModel
from flowgrpo.models.bagel.policy import PolicyApplier, PolicyUpdate, PolicyUpdateError
from flowgrpo.models.bagel.sampling import BagelSampler, SampleRequest
from flowgrpo.sampler_params import SamplerParams

Q = "language_model.model.layers.0.self_attn.q_proj_moe_gen"
DOWN = "language_model.model.layers.1.mlp_moe_gen.down_proj"
SPECIAL = SpecialTokens(im_start=384, im_end=385, vision_start=386, vision_end=387)
PARAMS = SamplerParams(num_points=5, height=32, width=32, window_size=2, window_range=(0, 3),
                       deterministic=True, decode_images=False)  # fmt: skip


def round_e4m3(x: torch.Tensor) -> torch.Tensor:
    """float64 -> the nearest e4m3fn value (ties to even), saturated at 448: 3 mantissa bits, so
    a value in [2^e, 2^(e+1)) sits on a grid of 2^(e-3); below the smallest normal 2^-6 the grid
    of the subnormals, 2^-9."""
    x = x.double()
    exponent = torch.floor(torch.log2(x.abs().clamp(min=2.0**-6)))
    step = torch.exp2(exponent - 3)
    return (torch.round(x / step) * step).clamp(-E4M3_MAX, E4M3_MAX)  # torch.round: half to even


def reference_quantize(t: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The rule in float64: scale = max(|row|) / 448 (rows of zeros: 1e-12 / 448), values the
    e4m3 rounding of row / scale."""
    t = t.double()
    scale = t.abs().amax(dim=-1, keepdim=True).clamp(min=1e-12) / 448.0
    return round_e4m3(t / scale), scale


def test_rowwise_quantization_is_the_rule_written_out() -> None:
    g = torch.Generator().manual_seed(0)
    t = torch.randn(64, 96, generator=g) * torch.logspace(-4, 3, 64)[:, None]  # rows of every scale
    t[3] = 0.0
    t[5, 7] = 1e-30  # far below the row's other values: flushed to 0 on the grid
    values, scales = quantize_rowwise(t)
    assert values.dtype == torch.float8_e4m3fn and scales.dtype == torch.float32 and scales.shape == (64, 1)
    ref_values, ref_scales = reference_quantize(t)
    torch.testing.assert_close(scales.double(), ref_scales, rtol=1e-6, atol=0)  # fp32 of the same division
    # the values from the fp32 scale, rounded as the rule says: equal, every one
    assert torch.equal(values.double(), round_e4m3(t.double() / scales.double()))
    assert torch.equal(values[3].double(), torch.zeros(96)) and values[5, 7] == 0
    assert torch.equal(values.double().abs().amax(dim=-1)[torch.arange(64) != 3], torch.full((63,), E4M3_MAX))
    # dequantized: within half a grid step of 2^-3 relative (3 mantissa bits) of the input
    back = values.double() * scales.double()
    tol = t.double().abs() * 2.0**-4 + scales.double() * 2.0**-10
    assert bool(((back - t.double()).abs() <= tol).all())
    torch.testing.assert_close(ref_values, values.double(), rtol=0, atol=1.0)  # at most one grid step apart


def test_the_fp8_gemm_is_the_float64_product_of_the_dequantized_operands() -> None:
    g = torch.Generator().manual_seed(1)
    x, w = torch.randn(2, 17, 64, generator=g), torch.randn(48, 64, generator=g) * 0.05
    wq, ws = quantize_rowwise(w)
    y = fp8_matmul(x, wq, ws, torch.float32)
    assert y.shape == (2, 17, 48) and y.dtype == torch.float32
    xq, xs = quantize_rowwise(x.reshape(-1, 64))
    expected = (xq.double() * xs.double()) @ (wq.double() * ws.double()).t()
    torch.testing.assert_close(y.reshape(-1, 48).double(), expected, rtol=1e-5, atol=1e-6)
    # and close to the unquantized product: FP8's error, a few percent of the output's size
    exact = x.double() @ w.double().t()
    relative = float((y.double() - exact).norm() / exact.norm())
    assert 1e-3 < relative < 0.06, relative


def test_a_frozen_fp8_layer_trains_its_input_through_two_fp8_gemms() -> None:
    """Fp8FrozenLinear (the '-fp8' trainer experiment): the forward is the rollout's FP8 GEMM, the
    input's gradient the float64 product of the gradient quantized per row and the weight per
    input channel (the rows of W^T; quantize_rowwise is the rule, tested above), no weight
    gradient, and the same compiled."""
    g = torch.Generator().manual_seed(2)
    linear = nn.Linear(64, 48)
    with torch.no_grad():
        linear.weight.copy_(torch.randn(48, 64, generator=g) * 0.05)
        linear.bias.copy_(torch.randn(48, generator=g))
    linear.requires_grad_(False)
    layer = Fp8FrozenLinear(linear)
    x = torch.randn(2, 17, 64, generator=g, requires_grad=True)
    y = layer(x)
    assert torch.equal(y, Fp8Linear.from_linear(linear)(x))  # the forward is the rollout's, bitwise
    grad = torch.randn(2, 17, 48, generator=g)
    y.backward(grad)
    assert x.grad is not None and linear.weight.grad is None
    g_values, g_scales = quantize_rowwise(grad.reshape(-1, 48))
    wt_values, wt_scales = quantize_rowwise(linear.weight.t())  # [64, 48]: one scale per input channel
    expected = (g_values.double() * g_scales.double()) @ (wt_values.double() * wt_scales.double()).t()
    torch.testing.assert_close(x.grad.reshape(-1, 64).double(), expected, rtol=1e-5, atol=1e-6)
    exact = grad.reshape(-1, 48).double() @ linear.weight.double()
    relative = float((x.grad.reshape(-1, 64).double() - exact).norm() / exact.norm())
    assert 1e-3 < relative < 0.06, relative  # FP8's error, not another product
    # compiled (the trainer compiles its query path), bitwise eager's: Inductor once laid out the
    # saved weight so that _scaled_mm refused it
    inputs = x.detach().clone().requires_grad_(True)
    torch.compile(layer, fullgraph=True)(inputs).backward(grad)
    assert inputs.grad is not None and torch.equal(inputs.grad, x.grad)


def test_two_frozen_fp8_layers_on_one_input_compile_with_dynamic_shapes_as_eager() -> None:
    """The LoRA trainer's attention reads one input through three frozen layers (q, k, v) and
    compiles with dynamic shapes: with the input's quantization inside the autograd function,
    Dynamo failed to trace the second layer ("lift_tracked_freevar_to_input should not be called
    on root SubgraphTracer", first seen on an H100). Compiled, the output and the input's gradient
    are eager's within fp32 rounding, at two sequence lengths (dynamic: one graph for both)."""
    g = torch.Generator().manual_seed(5)
    first, second = nn.Linear(64, 48, bias=False), nn.Linear(64, 32)
    for linear in (first, second):
        with torch.no_grad():
            linear.weight.copy_(torch.randn_like(linear.weight) * 0.05)
        linear.requires_grad_(False)
    layers = (Fp8FrozenLinear(first), Fp8FrozenLinear(second))

    def both(x: torch.Tensor) -> torch.Tensor:
        return layers[0](x).sum(-1) + layers[1](x).square().sum(-1)

    compiled = torch.compile(both, dynamic=True, fullgraph=True)
    for tokens in (17, 23):
        x = torch.randn(2, tokens, 64, generator=g)
        eager_in, compiled_in = x.clone().requires_grad_(True), x.clone().requires_grad_(True)
        eager_out, compiled_out = both(eager_in), compiled(compiled_in)
        # a compiled reduction splits its sums by thread: 1.9e-6 on an output of ~0.1 at two
        # threads (an FP8 grid step that flipped would cost ~6% of an element, thousands of times more)
        torch.testing.assert_close(compiled_out, eager_out, rtol=1e-5, atol=1e-5)
        eager_out.sum().backward()
        compiled_out.sum().backward()
        assert eager_in.grad is not None and compiled_in.grad is not None
        torch.testing.assert_close(compiled_in.grad, eager_in.grad, rtol=1e-5, atol=1e-5)


def test_in_bf16_the_bias_is_added_before_the_one_rounding_of_the_output() -> None:
    """The GEMM's epilogue (cuBLAS's, the CPU kernel's): the fp32 product plus the bf16 bias, then
    one rounding to bf16; an add after the GEMM would round twice (a quarter of the entries here)."""
    g = torch.Generator().manual_seed(4)
    x, w = torch.randn(3, 7, 64, generator=g).bfloat16(), torch.randn(48, 64, generator=g) * 0.05
    bias = torch.randn(48, generator=g)
    wq, ws = quantize_rowwise(w)
    fused = fp8_matmul(x, wq, ws, torch.bfloat16, bias=bias)
    product = fp8_matmul(x.float(), wq, ws, torch.float32)  # the same quantized operands, fp32 out
    assert torch.equal(fused, (product + bias.bfloat16().float()).bfloat16())
    twice = (product.bfloat16().float() + bias.bfloat16().float()).bfloat16()
    assert int((fused != twice).sum()) > fused.numel() // 10
    # with fast accumulation the bias comes after the GEMM (the CPU's kernel has no fast accumulation)
    assert torch.equal(fp8_matmul(x, wq, ws, torch.bfloat16, bias=bias, fast_accum=True), twice)


def test_an_fp8_linear_keeps_the_bias_and_its_weight_is_written_by_set_weight() -> None:
    torch.manual_seed(2)
    linear = nn.Linear(32, 16, bias=True)
    layer = Fp8Linear.from_linear(linear)
    x = torch.randn(5, 32)
    values, scales = quantize_rowwise(linear.weight)
    assert torch.equal(layer.weight, values) and torch.equal(layer.weight_scale, scales)
    torch.testing.assert_close(layer(x), fp8_matmul(x, values, scales, torch.float32) + linear.bias)
    assert layer(torch.empty(2, 0, 32)).shape == (2, 0, 16)  # an expert with no token in a forward
    new = torch.randn(16, 32)
    layer.set_weight(new)
    assert torch.equal(layer.weight, quantize_rowwise(new)[0])
    with torch.device("meta"):
        waiting = Fp8Linear.from_linear(nn.Linear(32, 16, bias=False))
    waiting.set_weight(new)  # a model waiting for its weights gets storage of its own
    assert not waiting.weight.is_meta and torch.equal(waiting.weight_scale, quantize_rowwise(new)[1])


def test_quantize_gen_path_swaps_the_gen_linears_and_nothing_else() -> None:
    torch.manual_seed(3)
    model = BagelModel(tiny()).eval()
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    originals = quantize_gen_path(model)
    swapped = sorted(n for n, m in model.named_modules() if isinstance(m, Fp8Linear))
    layers = range(tiny().layers)
    expected = sorted(f"language_model.model.layers.{i}.{s}" for i in layers for s in GEN_PATH_LINEARS)
    assert swapped == expected == sorted(originals)
    for name, weight in originals.items():
        assert torch.equal(weight, before[name + ".weight"])  # the merge bases: the weights as loaded
    for name, param in model.named_parameters():  # the und path, norms, heads: untouched
        if name.removesuffix(".weight") not in originals:
            assert torch.equal(param, before[name]), name
    assert isinstance(model.decoder.layers[0].mlp.up_proj, nn.Linear)  # the und expert's


def sample(model: BagelModel) -> torch.Tensor:
    requests = [SampleRequest("p", i, torch.tensor([5, 6, 7 + i])) for i in range(2)]
    return BagelSampler(model, None, SPECIAL).generate(requests, PARAMS, seed=0, step=0).final_latents


def test_an_fp8_model_samples_close_to_its_fp32_self() -> None:
    torch.manual_seed(4)
    model = BagelModel(tiny()).eval()
    fp32 = sample(model)
    quantize_gen_path(model)
    fp8 = sample(model)
    relative = float((fp8 - fp32).norm() / fp32.norm())
    assert 0 < relative < 0.05, relative


def lora(model: BagelModel, rank: int = 4, seed: int = 5) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    params = dict(model.named_parameters())
    tensors = {}
    for module in (Q, DOWN):
        out_f, in_f = params[module + ".weight"].shape
        tensors[module + ".lora_A.weight"] = torch.randn(rank, in_f, generator=g) * 0.1
        tensors[module + ".lora_B.weight"] = torch.randn(out_f, rank, generator=g) * 0.1
    return tensors


def test_lora_is_merged_in_fp32_then_quantized_and_unmerged_back_to_the_base() -> None:
    torch.manual_seed(6)
    model = BagelModel(tiny()).eval()
    applier = PolicyApplier(model)
    base = quantize_gen_path(model)
    applier.keep_bases(base)
    tensors = lora(model)
    applier.apply(PolicyUpdate(1, "lora", tensors, lora_rank=4, lora_alpha=8.0))
    for module in (Q, DOWN):
        merged = base[module].double() + 2.0 * (
            tensors[module + ".lora_B.weight"].double() @ tensors[module + ".lora_A.weight"].double()
        )
        layer = model.get_submodule(module)
        ref_values, _ = reference_quantize(merged)
        assert torch.equal(layer.weight, quantize_rowwise(merged.float())[0])  # fp32 merge, then once
        assert float((layer.weight.double() - ref_values).abs().max()) <= 1.0
    # a later version adapting only Q: DOWN goes back to its quantized base, exactly
    only_q = {k: v for k, v in tensors.items() if k.startswith(Q)}
    applier.apply(PolicyUpdate(2, "lora", only_q, lora_rank=4, lora_alpha=8.0))
    assert torch.equal(model.get_submodule(DOWN).weight, quantize_rowwise(base[DOWN])[0])


def test_a_gen_path_update_is_quantized_and_an_fp8_layer_without_its_base_refuses_a_merge() -> None:
    torch.manual_seed(7)
    model = BagelModel(tiny()).eval()
    quantize_gen_path(model)
    applier = PolicyApplier(model)  # no keep_bases: the unquantized weights were not kept
    new = torch.randn(model.get_submodule(Q).weight.shape)
    applier.apply(PolicyUpdate(1, "gen_path", {Q + ".weight": new}))
    assert torch.equal(model.get_submodule(Q).weight, quantize_rowwise(new)[0])
    with pytest.raises(PolicyUpdateError, match="held in FP8 and its unquantized base was not kept"):
        applier.apply(PolicyUpdate(2, "lora", lora(model), lora_rank=4, lora_alpha=8.0))


def test_the_shared_base_is_quantized_into_the_rollouts_own_fp8_copy(tmp_path: object) -> None:
    """rollout.base_weights=trainer with FP8: the trainer's bf16 gen path (views) becomes this
    rollout's FP8 copy; what no update writes aliases the views; merges start from the views."""
    from flowgrpo.models.bagel.checkpoint import checkpoint_key
    from flowgrpo.services.rollout.shared_base import attach_base

    torch.manual_seed(8)
    trainer = BagelModel(tiny()).to(torch.bfloat16).eval()
    views = {checkpoint_key(n): p.detach() for n, p in trainer.named_parameters()}
    with torch.device("meta"):
        rollout = BagelModel(tiny()).to(torch.bfloat16).eval().requires_grad_(False)
    assert quantize_gen_path(rollout) == {}  # on meta: nothing to keep, the views are the base
    shared, merge_bases = attach_base(rollout, views, owned=lambda key: "moe_gen" in key, checkpoint="unused")
    params = dict(rollout.named_parameters())
    for name in (Q, DOWN):
        key = checkpoint_key(name + ".weight")
        assert torch.equal(rollout.get_submodule(name).weight, quantize_rowwise(views[key])[0])
        assert merge_bases[key.removesuffix(".weight")] is views[key]
    und = "language_model.model.layers.0.mlp.up_proj.weight"
    assert und in shared and params[und].data_ptr() == views[checkpoint_key(und)].data_ptr()
    fp8_bytes = sum(m.weight.numel() for m in rollout.modules() if isinstance(m, Fp8Linear))
    assert fp8_bytes == sum(p.numel() for n, p in trainer.named_parameters() if n.endswith(GEN_WEIGHTS))


GEN_WEIGHTS = tuple(s + ".weight" for s in GEN_PATH_LINEARS)


def test_a_cpu_needs_no_fp8_check_and_the_layers_repr_says_fp8() -> None:
    check_fp8_device("cpu")
    assert "e4m3 row-wise" in repr(Fp8Linear(8, 16, None, torch.device("cpu")))
    assert "fast accumulation" in repr(Fp8Linear(8, 16, None, torch.device("cpu"), fast_accum=True))
    assert math.isclose(E4M3_MAX, torch.finfo(torch.float8_e4m3fn).max)


def test_the_engine_builds_its_fp8_layers_with_the_configured_accumulation(tmp_path: Path) -> None:
    """rollout.fp8_fast_accum reaches every FP8 layer of the engine (a GPU option: on a CPU it
    changes no number, so this checks the wiring)."""
    from flowgrpo.models.bagel.checkpoint import make_tiny_bagel
    from flowgrpo.services.rollout.engine import NativeBagelEngine

    folder = make_tiny_bagel(tmp_path, seed=0)
    for fast in (False, True):
        engine = NativeBagelEngine.from_checkpoint(
            folder, device="cpu", dtype=torch.float32, max_batch_samples=4, fp8=True, fp8_fast_accum=fast
        )
        layers = [m for m in engine.sampler.model.modules() if isinstance(m, Fp8Linear)]
        assert len(layers) == 7 * engine.sampler.model.config.layers
        assert {layer.fast_accum for layer in layers} == {fast}
