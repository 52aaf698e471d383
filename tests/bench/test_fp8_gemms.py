"""``bench fp8``'s GEMM table on the tiny model (CPU): the shapes are the model's gen-path linears,
the inputs quantized are the distinct ones, and the per-forward sums are the medians written out."""

from __future__ import annotations

import pytest
import torch

from flowgrpo.models.bagel.config import tiny
from flowgrpo.services.bench.common import random_bagel
from flowgrpo.services.bench.fp8_gemms import gemm_table, layer_linears


def test_the_table_times_each_gen_linear_and_each_distinct_input() -> None:
    cfg = tiny()
    model = random_bagel(cfg, torch.float32, torch.device("cpu"))
    q, kv = cfg.heads * cfg.head_dim, cfg.kv_heads * cfg.head_dim
    h, i = cfg.hidden, cfg.intermediate
    expected = {"q_proj": (h, q), "k_proj": (h, kv), "v_proj": (h, kv), "o_proj": (q, h),
                "gate_proj": (h, i), "up_proj": (h, i), "down_proj": (i, h)}  # fmt: skip
    assert layer_linears(model) == expected
    table = gemm_table(model, rows=40, device=torch.device("cpu"), repeats=3)
    assert [(r["linear"], r["in"], r["out"]) for r in table["linears"]] == [
        (k, *v) for k, v in expected.items()
    ]
    assert all(r["flop"] == 2 * 40 * r["in"] * r["out"] for r in table["linears"])
    assert {e["input"]: e["shape"] for e in table["quantize"]} == {
        "qkv": [40, h], "o": [40, q], "mlp": [40, h], "down": [40, i]}  # fmt: skip
    forward = table["per_forward_ms"]
    for key in ("bf16", "fp8_rowwise", "fp8_tensorwise"):
        medians = [r[f"{key}_ms"].median for r in table["linears"]]
        assert forward[f"{key}_gemms"] == pytest.approx(cfg.layers * sum(medians)) and min(medians) > 0
    assert forward["quantize_eager"] == pytest.approx(
        cfg.layers * sum(e["eager_ms"].median for e in table["quantize"])
    )
    assert "quantize_compiled" not in forward  # compiled only on a GPU
