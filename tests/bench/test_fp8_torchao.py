"""``bench fp8 --torchao`` on the tiny model (bf16, CPU): torchao's float8 takes the layers ours
swaps and no other, gives them back untouched, computes what ours computes within e4m3's rounding,
and the whole run measures it between bf16 and ours. torchao refuses float8 on a CPU; these tests
lift that one check (torchao's own numbers on a CPU are its reference kernels', as ours); the gpu
test runs it where torchao allows it.

CI does not install torchao (the ``fp8`` extra): peft imports an installed torchao at its own
import, which costs every trainer process 0.3 s and its log two warnings. These tests run where it
is installed: here, and on the device, whose wheels bench/fetch_gpu_wheels.sh fetches."""

from __future__ import annotations

import pytest
import torch

from flowgrpo.models.bagel.config import tiny, tiny_vae
from flowgrpo.models.bagel.fp8 import Fp8Linear, gen_path_linears, quantize_gen_path
from flowgrpo.models.bagel.sampling import BagelSampler
from flowgrpo.sampler_params import SamplerParams
from flowgrpo.services.bench import fp8, fp8_torchao
from flowgrpo.services.bench.common import SPECIAL_TINY, make_requests, random_bagel, random_vae

pytest.importorskip("torchao", reason="torchao is not installed: pip install 'flowgrpo[fp8]'")


@pytest.fixture
def no_hardware_check(monkeypatch: pytest.MonkeyPatch) -> None:
    from torchao.quantization import quant_api

    monkeypatch.setattr(quant_api, "_check_hardware_support", lambda granularity: None)


def latents(model: torch.nn.Module, vae: torch.nn.Module) -> torch.Tensor:
    params = SamplerParams(num_points=5, height=32, width=32, window_size=4, window_range=(0, 4),
                           deterministic=True, decode_images=False)  # fmt: skip
    requests = make_requests(3, 6, SPECIAL_TINY)
    return BagelSampler(model, vae, SPECIAL_TINY).generate(requests, params, seed=1, step=0).latents


@torch.no_grad()
def test_torchao_quantizes_our_layers_and_gives_them_back(no_hardware_check: None) -> None:
    cpu = torch.device("cpu")
    model, vae = random_bagel(tiny(), torch.bfloat16, cpu), random_vae(tiny_vae(), torch.bfloat16, cpu)
    reference = latents(model, vae)
    names = gen_path_linears(model)
    assert len(names) == 7 * tiny().layers  # q, k, v, o, gate, up, down of every layer's gen expert
    kept = fp8_torchao.quantize_gen_path_torchao(model)
    assert set(kept) == set(names)
    quantized = {n for n, p in model.named_parameters() if type(p) is not torch.nn.Parameter}
    assert quantized == {f"{n}.weight" for n in names}  # torchao's tensors there, nowhere else
    theirs = latents(model, vae)
    fp8_torchao.restore(model, kept)
    assert torch.equal(latents(model, vae), reference)  # the bf16 model, bitwise
    quantize_gen_path(model)
    assert sum(isinstance(m, Fp8Linear) for m in model.modules()) == len(names)
    ours = latents(model, vae)
    # both quantize the same layers by the same rule; four denoising steps of e4m3 error apart
    scale = float(reference.abs().max())
    assert 0 < float((theirs - reference).abs().max()) < 0.02 * scale
    assert float((theirs - ours).abs().max()) < 0.02 * scale


def test_torchao_is_refused_in_one_line_where_it_cannot_run() -> None:
    cpu = torch.device("cpu")
    assert "compute capability 8.9+" in str(fp8_torchao.refusal(cpu, "bf16"))
    assert "not fp32" in str(fp8_torchao.refusal(cpu, "fp32"))
    model = random_bagel(tiny(), torch.float32, cpu)
    with pytest.raises(ValueError, match=r"takes bf16 weights; the gen path's: torch\.float32"):
        fp8_torchao.quantize_gen_path_torchao(model)


def measured(device: str) -> dict[str, object]:
    args = fp8._parser().parse_args(
        ["--model", "tiny", "--device", device, "--dtype", "bf16", "--shapes", "32x2", "--num-points", "9",
         "--gap-samples", "0", "--no-profile", "--no-gemms", "--no-compile", "--torchao"]
    )  # fmt: skip
    report = fp8.run(args, torch.device(device))
    assert list(report["rows"]) == ["bf16", "fp8_torchao", "fp8"]
    (theirs,), (ours,) = report["rows"]["fp8_torchao"], report["rows"]["fp8"]
    assert theirs.step_tflop == ours.step_tflop > 0
    assert report["torchao_version"] == "0.18.0"
    expected = ours.images_per_s.median / theirs.images_per_s.median
    assert report["fp8_over_torchao_images_per_s"]["32x2"].median == pytest.approx(expected, rel=0.5)
    return report


def test_the_benchmark_measures_torchao_between_bf16_and_ours(no_hardware_check: None) -> None:
    measured("cpu")


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_the_benchmark_runs_torchao_on_a_gpu_without_lifting_its_check() -> None:
    """The device's own path (bench/gpu_check.sh, with the wheels of bench/fetch_gpu_wheels.sh)."""
    assert fp8_torchao.refusal(torch.device("cuda"), "bf16") is None
    measured("cuda")


def test_a_torchao_failure_is_one_line_and_ours_is_measured_regardless(
    no_hardware_check: None, monkeypatch: pytest.MonkeyPatch
) -> None:
    """One device call takes every figure: torchao failing (a compile it cannot take, say) costs
    its rows only."""
    measure_shapes = fp8._measure_shapes

    def failing_for_torchao(*args: object) -> None:
        if args[4] == "fp8_torchao":
            raise RuntimeError("torchao cannot\n  take this")
        measure_shapes(*args)  # type: ignore[arg-type]

    monkeypatch.setattr(fp8, "_measure_shapes", failing_for_torchao)
    args = fp8._parser().parse_args(
        ["--model", "tiny", "--device", "cpu", "--dtype", "bf16", "--shapes", "32x2", "--num-points", "9",
         "--gap-samples", "2", "--gap-resolution", "32", "--no-profile", "--no-gemms", "--no-compile",
         "--torchao"]
    )  # fmt: skip
    report = fp8.run(args, torch.device("cpu"))
    assert report["torchao_error"] == "RuntimeError: torchao cannot take this"
    assert report["rows"]["fp8_torchao"] == [] and "fp8_over_torchao_images_per_s" not in report
    assert len(report["rows"]["fp8"]) == 1 and report["fp8_images_per_s_ratio"]["32x2"].median > 0
    assert report["logp_gap"]["all"]["max"] > report["logp_gap_bf16"]["all"]["max"]  # ours, on bf16 layers
