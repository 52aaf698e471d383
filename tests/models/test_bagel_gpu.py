"""The query path on a CUDA device (tiny model): the unmasked runs take the flash kernel, and the
inductor-compiled layers agree with eager. GPU-only: run by bench/rollout_gpu.sh, never in CI."""

from __future__ import annotations

import pytest
import torch
from torch.nn.attention import SDPBackend, sdpa_kernel

from flowgrpo.models.bagel.attention import KVCache
from flowgrpo.models.bagel.config import tiny
from flowgrpo.models.bagel.model import BagelModel, latent_position_ids
from flowgrpo.models.bagel.parallelize import compile_query_layers, uncompile_query_layers

pytestmark = pytest.mark.gpu
MARKERS = {"soi_id": 386, "eoi_id": 387}


def rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a - b).norm() / b.norm())


@pytest.fixture(scope="module")
def setup() -> tuple[BagelModel, BagelModel, KVCache, KVCache, tuple[torch.Tensor, ...]]:
    if not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    torch.manual_seed(0)
    fp32 = BagelModel(tiny()).cuda().eval()
    bf16 = BagelModel(tiny()).cuda().eval()
    bf16.load_state_dict(fp32.state_dict())
    bf16.to(torch.bfloat16)
    ids = torch.randint(1, 380, (2, 9), device="cuda")
    mask = torch.ones(2, 9, dtype=torch.bool, device="cuda")  # equal lengths: one unmasked run
    with torch.no_grad():
        caches = [
            KVCache.cat_rows([m.prefill(ids, mask), KVCache.empty(m.config, 2, dtype, "cuda")])
            for m, dtype in ((fp32, torch.float32), (bf16, torch.bfloat16))
        ]
    x = torch.randn(4, 20, 64, device="cuda")
    t = torch.tensor([1.0, 0.5, 1.0, 0.5], device="cuda")
    pos = latent_position_ids(4, 5, tiny().max_latent_size, "cuda")
    return fp32, bf16, caches[0], caches[1], (x, t, pos)


@torch.no_grad()
def test_bf16_query_runs_on_flash_alone(setup: tuple) -> None:  # type: ignore[type-arg]
    """Tolerance 3e-2: with SDPA restricted to flash (it refuses masks), the bf16 forward runs and
    stays near the fp32 one."""
    fp32, bf16, cache32, cache16, (x, t, pos) = setup
    assert cache16.query_runs() is not None
    with sdpa_kernel([SDPBackend.FLASH_ATTENTION]):
        v16 = bf16.predict_velocity(cache16, x, t, pos, **MARKERS)
    v32 = fp32.predict_velocity(cache32, x, t, pos, **MARKERS)
    assert rel_err(v16, v32) < 3e-2


@torch.no_grad()
def test_inductor_compiled_layers_match_eager(setup: tuple) -> None:  # type: ignore[type-arg]
    """Tolerance 1e-2 (bf16 rounding of fused vs unfused elementwise work)."""
    _, bf16, _, cache16, (x, t, pos) = setup
    eager = bf16.predict_velocity(cache16, x, t, pos, **MARKERS)
    compile_query_layers(bf16)
    try:
        compiled = bf16.predict_velocity(cache16, x, t, pos, **MARKERS)
    finally:
        uncompile_query_layers(bf16)
    assert rel_err(compiled, eager) < 1e-2
