"""The kernel profile's bookkeeping: kinds from kernel names, per-call times and shares."""

from __future__ import annotations

import pytest

from flowgrpo.services.bench.kernels import kind_of, summarize

NAMES = {  # names as Hopper's libraries and Inductor write them
    "nvjet_qqtst_128x256_64x4_2x1_v_bz_coopB_TNT": "gemm",  # cuBLAS's FP8 GEMM
    "sm90_xmma_gemm_bf16bf16_bf16f32_f32_tn_n_tilesize128x256x64": "gemm",
    "cutlass3x_sm90_tensorop_gemm_e4m3_e4m3": "gemm",
    "aten::_scaled_mm": "gemm",
    "aten::addmm": "gemm",
    "void flash::flash_fwd_kernel<Flash_fwd_kernel_traits<128, 128, 64, 4>>": "attention",
    "cudnn_generated_fort_native_sdpa_sm90_flash_fprop": "attention",
    "aten::_scaled_dot_product_flash_attention_for_cpu": "attention",
    "triton_per_fused_abs_amax_clamp_div_mul_0": "compiled (fused)",
    # the quantization before an FP8 GEMM, named after the op it feeds (an H100's profile)
    "triton_red_fused__scaled_mm__to_copy_abs_amax_clamp_div_mul_silu_t_view_2": "compiled (fused)",
    "triton_tem_fused_mm_0": "gemm",  # Inductor's GEMM template
    "void at::native::vectorized_elementwise_kernel<4, at::native::CUDAFunctor_add<float>>": "other",
    "aten::copy_": "other",
    "aten::matmul_backward_helper": "other",  # aten::matmul only as the whole name
}


@pytest.mark.parametrize(("name", "kind"), NAMES.items())
def test_a_kernel_name_gives_its_kind(name: str, kind: str) -> None:
    assert kind_of(name) == kind


def test_the_summary_is_per_call_with_shares_that_add_up() -> None:
    kernels = {"nvjet_a": (3000.0, 6), "sm90_xmma_gemm_b": (1500.0, 3), "flash_fwd": (900.0, 3),
               "triton_poi_fused_x": (450.0, 9), "elementwise": (150.0, 3)}  # fmt: skip
    report = summarize(kernels, calls=3)
    total = 3000 + 1500 + 900 + 450 + 150  # microseconds over 3 calls
    assert report["ms_per_call"] == pytest.approx(total / 1e3 / 3)
    assert report["kinds"]["gemm"] == pytest.approx({"ms_per_call": 4500 / 1e3 / 3, "share": 4500 / total})
    assert report["kinds"]["attention"]["share"] == pytest.approx(900 / total)
    assert report["kinds"]["compiled (fused)"]["ms_per_call"] == pytest.approx(0.15)
    assert report["kinds"]["other"]["share"] == pytest.approx(150 / total)
    assert [k["name"] for k in report["top"]] == ["nvjet_a", "sm90_xmma_gemm_b", "flash_fwd",
                                                  "triton_poi_fused_x", "elementwise"]  # fmt: skip
    assert report["top"][0] == {"name": "nvjet_a", "kind": "gemm", "ms_per_call": 1.0, "launches": 2.0}
    assert summarize({}, calls=3)["kinds"]["gemm"]["share"] == 0.0
