"""The gen path's GEMMs at a forward's own shapes, one at a time (``bench fp8``'s GEMM table):
where FP8's time goes between its GEMMs and the quantization of their inputs.

For one CFG forward of ``rows`` query rows, each of the seven linear layers of a decoder layer
(``GEN_PATH_LINEARS``: q, k, v, o, gate, up, down) is timed on random data as

- bf16: ``F.linear`` of bf16 operands (what the bf16 rollout runs);
- FP8 row-wise: ``torch._scaled_mm`` of operands already in e4m3, a scale per row (what
  ``Fp8Linear`` runs after quantizing its input);
- FP8 tensor-wise: the same with one scale per operand (cuBLAS's kernel; coarser numbers);

and each distinct input the layer quantizes (q/k/v share one, gate/up another, o and down their
own) by ``fp8.quantize_rowwise``, eager and compiled. A layer's sums times the model's layers
give the forward's GEMM and quantization milliseconds, to set beside the measured forward.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
import torch.nn.functional as F

from flowgrpo.models.bagel.config import GEN_PATH_LINEARS
from flowgrpo.models.bagel.fp8 import quantize_rowwise
from flowgrpo.models.bagel.model import BagelModel
from flowgrpo.services.bench.stats import Figure, timed

# which linears read the same input (quantized once a forward when inductor shares it)
SHARED_INPUT = {"q_proj": "qkv", "k_proj": "qkv", "v_proj": "qkv", "o_proj": "o",
                "gate_proj": "mlp", "up_proj": "mlp", "down_proj": "down"}  # fmt: skip


def layer_linears(model: BagelModel) -> dict[str, tuple[int, int]]:
    """(in, out) of each gen-path linear of decoder layer 0, by short name (``q_proj``)."""
    found: dict[str, tuple[int, int]] = {}
    for name, module in model.named_modules():
        for suffix in GEN_PATH_LINEARS:
            if name.endswith(f"layers.0.{suffix}"):  # the first decoder layer's
                short = suffix.rsplit(".", 1)[1].removesuffix("_moe_gen")
                found.setdefault(short, (module.in_features, module.out_features))
    return found


Timer = Callable[[Callable[[], object]], Figure]


def gemm_table(model: BagelModel, rows: int, device: torch.device, repeats: int) -> dict[str, Any]:
    """The per-linear and per-forward figures described above, for ``rows`` query rows."""
    layers = model.config.layers
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    g = torch.Generator(device=device).manual_seed(0)

    def ms(fn: Callable[[], object]) -> Figure:
        return timed(fn, device=device, repeats=repeats).scaled(1e3, "ms")

    table: list[dict[str, Any]] = []
    inputs: dict[str, torch.Tensor] = {}  # the distinct inputs a layer quantizes
    for short, (n_in, n_out) in layer_linears(model).items():
        x = torch.randn(rows, n_in, device=device, dtype=dtype, generator=g)
        w = torch.randn(n_out, n_in, device=device, dtype=dtype, generator=g) * n_in**-0.5
        table.append({"linear": short, "in": n_in, "out": n_out, **time_linear(x, w, ms)})
        inputs.setdefault(SHARED_INPUT[short], x)
    compiled = torch.compile(quantize_rowwise, dynamic=False) if device.type == "cuda" else None
    quantize = [{"input": shared, "shape": list(x.shape), **time_quantize(x, compiled, ms)}
                for shared, x in inputs.items()]  # fmt: skip
    return {"rows": rows, "layers": layers, "linears": table, "quantize": quantize,
            "per_forward_ms": per_forward(table, quantize, layers)}  # fmt: skip


def time_linear(x: torch.Tensor, w: torch.Tensor, ms: Timer) -> dict[str, Any]:
    """One linear layer's GEMM in the weights' dtype, and in FP8 with row-wise and tensor-wise scales."""
    (xq, xs), (wq, ws) = quantize_rowwise(x), quantize_rowwise(w)
    one = torch.ones((), device=x.device)
    return {
        "flop": 2 * x.shape[0] * x.shape[1] * w.shape[0],
        "bf16_ms": ms(lambda: F.linear(x, w)),
        "fp8_rowwise_ms": ms(
            lambda: torch._scaled_mm(xq, wq.t(), scale_a=xs, scale_b=ws.t(), out_dtype=x.dtype)
        ),
        "fp8_tensorwise_ms": ms(
            lambda: torch._scaled_mm(xq, wq.t(), scale_a=one, scale_b=one, out_dtype=x.dtype)
        ),
    }


def time_quantize(
    x: torch.Tensor, compiled: Callable[[torch.Tensor], object] | None, ms: Timer
) -> dict[str, Any]:
    """An input's row-wise quantization, eager and (on a GPU) compiled."""
    out: dict[str, Any] = {"eager_ms": ms(lambda: quantize_rowwise(x))}
    if compiled is not None:
        out["compiled_ms"] = ms(lambda: compiled(x))
    return out


def per_forward(
    linears: list[dict[str, Any]], quantize: list[dict[str, Any]], layers: int
) -> dict[str, float]:
    """The medians summed over a layer's linears (or inputs), times the layers."""

    def total(entries: list[dict[str, Any]], key: str) -> float:
        return float(layers * sum(e[key].median for e in entries if key in e))

    out = {key.removesuffix("_ms") + "_gemms": total(linears, key)
           for key in ("bf16_ms", "fp8_rowwise_ms", "fp8_tensorwise_ms")}  # fmt: skip
    out["quantize_eager"] = total(quantize, "eager_ms")
    if all("compiled_ms" in e for e in quantize):
        out["quantize_compiled"] = total(quantize, "compiled_ms")
    return out


def print_gemms(title: str, report: dict[str, Any]) -> None:
    forward = report["per_forward_ms"]
    compiled = forward.get("quantize_compiled", float("nan"))
    print(f"{title}: {report['rows']} rows x {report['layers']} layers; the forward's gen-path GEMMs: "
          f"bf16 {forward['bf16_gemms']:.1f} ms, FP8 row-wise {forward['fp8_rowwise_gemms']:.1f} ms, "
          f"FP8 tensor-wise {forward['fp8_tensorwise_gemms']:.1f} ms; quantizing their inputs "
          f"{forward['quantize_eager']:.1f} ms eager, {compiled:.1f} ms compiled", flush=True)  # fmt: skip
    for row in report["linears"]:
        bf16, fp8 = row["bf16_ms"].median, row["fp8_rowwise_ms"].median
        print(f"  {row['linear']:<9} {row['in']}x{row['out']}: bf16 {bf16:.3f} ms, FP8 row-wise {fp8:.3f} ms "
              f"({bf16 / fp8:.2f}x), tensor-wise {row['fp8_tensorwise_ms'].median:.3f} ms")  # fmt: skip
