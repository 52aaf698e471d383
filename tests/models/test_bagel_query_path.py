"""The static image-query path of ``predict_velocity``, its compilation (parallelize.py) and the
rollout benchmark's FLOP count and CPU smoke run (tiny model, CPU, fp32). Each test says whether it
expects bitwise equality or a tolerance."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from test_bagel_model import prompts  # same folder: the shared padded-prompt builder
from torch import Tensor
from torch._dynamo.testing import CompileCounter

from flowgrpo.models.bagel.config import bagel_7b, tiny
from flowgrpo.models.bagel.model import (
    MAX_QUERY_RUNS,
    BagelModel,
    KVCache,
    QueryRun,
    latent_position_ids,
    query_mask,
    query_runs,
)
from flowgrpo.models.bagel.parallelize import compile_query_layers, uncompile_query_layers
from flowgrpo.services.bench import rollout

SOI, EOI = 386, 387
MARKERS = {"soi_id": SOI, "eoi_id": EOI}


def general_path(model: BagelModel, cache: KVCache, x: Tensor, t: Tensor, pos: Tensor) -> Tensor:
    """The velocity through the general decoder path (routing gathers, one masked SDPA call)."""
    b, n, _ = x.shape
    embeds, is_gen = model.image_query(x, t, pos, **MARKERS)
    positions = cache.lengths[:, None].expand(b, n + 2)
    hidden, _ = model.decoder(embeds, is_gen, positions, query_mask(cache.key_mask, n + 2), past=cache)
    velocity: Tensor = model.llm2vae(hidden[:, 1 : n + 1])
    return velocity.float()


@pytest.fixture(scope="module")
def model() -> BagelModel:
    torch.manual_seed(0)
    return BagelModel(tiny()).eval()


def test_query_runs_group_consecutive_prefix_rows() -> None:
    """Exact: right-padded rows of equal length form one run, empty rows another; a left-padded
    row, or more than MAX_QUERY_RUNS runs, means the masked fallback (None)."""
    lengths = torch.tensor([3, 3, 5, 0, 0])
    mask = torch.arange(6) < lengths[:, None]
    assert query_runs(mask) == [QueryRun(0, 2, 3), QueryRun(2, 3, 5), QueryRun(3, 5, 0)]
    left = mask.clone()
    left[2] = left[2].flip(0)
    assert query_runs(left) is None
    many = torch.arange(MAX_QUERY_RUNS + 1)[:, None] > torch.arange(MAX_QUERY_RUNS)
    assert query_runs(many) is None
    assert query_runs(torch.zeros(3, 0, dtype=torch.bool)) == [QueryRun(0, 3, 0)]


@torch.no_grad()
@pytest.mark.parametrize("left_pad", [False, True], ids=["runs", "masked-fallback"])
def test_query_path_equals_general_path(model: BagelModel, left_pad: bool) -> None:
    """Tolerance (fp32): 4 prompts of different lengths + 4 empty-context rows in one forward, by
    the static query path (unmasked runs, or the masked fallback for left padding) == the general
    routing path; the runs are memoised on the cache."""
    ids, mask = prompts([5, 9, 9, 2], left_pad=left_pad)
    cond = model.prefill(ids, mask)
    cache = KVCache.cat_rows([cond, KVCache.empty(model.config, 4, torch.float32, "cpu")])
    g = torch.Generator().manual_seed(2)
    x, t = torch.randn(8, 12, 64, generator=g), torch.rand(8, generator=g)
    pos = latent_position_ids(3, 4, model.config.max_latent_size)
    fast = model.predict_velocity(cache, x, t, pos, **MARKERS)
    torch.testing.assert_close(fast, general_path(model, cache, x, t, pos), atol=2e-5, rtol=2e-5)
    assert (cache.query_runs() is None) == left_pad
    assert cache.query_runs() is cache.query_runs()


@torch.no_grad()
def test_compiled_query_layers_match_eager_and_compile_once(model: BagelModel) -> None:
    """Tolerance (fp32, aot_eager backend): compiled == eager for two batch sizes and resolutions;
    one graph per compiled method serves every layer and every shape (dynamic=True); uncompile
    restores the eager methods."""
    ids, mask = prompts([4, 7, 6])
    cond = model.prefill(ids, mask)
    cache = KVCache.cat_rows([cond, KVCache.empty(model.config, 3, torch.float32, "cpu")])
    g = torch.Generator().manual_seed(3)
    cases = []
    for rows, (h, w) in [(slice(0, 6), (3, 4)), (slice(1, 5), (4, 5))]:
        sub = cache.select(torch.arange(6)[rows])
        x, t = torch.randn(sub.key_mask.shape[0], h * w, 64, generator=g), torch.rand(sub.key_mask.shape[0])
        pos = latent_position_ids(h, w, model.config.max_latent_size)
        cases.append((sub, x, t, pos, model.predict_velocity(sub, x, t, pos, **MARKERS)))

    counter = CompileCounter()
    compile_query_layers(model, backend=counter)
    try:
        for sub, x, t, pos, eager in cases:
            compiled = model.predict_velocity(sub, x, t, pos, **MARKERS)
            torch.testing.assert_close(compiled, eager, atol=1e-5, rtol=1e-5)
    finally:
        uncompile_query_layers(model)
    assert counter.frame_count == 2  # query_qkv and query_out, once each
    assert "query_qkv" not in vars(model.decoder.layers[0])


def test_spec_flop_count() -> None:
    """Exact parameter count; SPEC section 7's figures: 2.76e13 (512px) and 1.20e14 (1024px) per
    text-CFG step of one sample (two rows of empty context), 6.525e9 gen matmul parameters."""
    cfg = bagel_7b()
    assert rollout.gen_matmul_params(cfg) == 6_525_288_448
    assert rollout.spec_step_flops(cfg, 1024, [0, 0]) == pytest.approx(2.76e13, rel=2e-3)
    assert rollout.spec_step_flops(cfg, 4096, [0, 0]) == pytest.approx(1.20e14, rel=4e-3)
    extra = rollout.spec_step_flops(cfg, 1024, [48, 0]) - rollout.spec_step_flops(cfg, 1024, [0, 0])
    assert extra == 4 * 1026 * 48 * 128 * 28 * 28  # prompt keys only add attention FLOPs


def test_bench_requests_share_prompts_by_group() -> None:
    """Exact: 17 samples = 16 of prompt p0 and 1 of p1 (8 tokens longer), with the markers."""
    special = rollout.SPECIAL_TINY
    reqs = rollout.make_requests(17, 10, special)
    assert [r.prompt_uid for r in reqs] == ["p0"] * 16 + ["p1"]
    assert reqs[0].prompt_ids.numel() == 10 and reqs[16].prompt_ids.numel() == 18
    assert reqs[0].prompt_ids[0] == special.im_start and reqs[0].prompt_ids[-1] == special.im_end
    assert rollout.context_lengths(reqs[15:]) == [10, 18, 0, 0]
    assert rollout.parse_shapes("512x8,1024X2") == [(512, 8), (1024, 2)] and rollout.parse_shapes("") == []


def test_bench_smoke_on_cpu(tmp_path: Path) -> None:
    """The whole benchmark on the tiny model (fp32, CPU, aot_eager): every code path runs and the
    JSON holds a row per shape, the variants and the drift; the fast path agrees with the general one."""
    out = tmp_path / "r.json"
    argv = ["--model", "tiny", "--device", "cpu", "--dtype", "fp32", "--shapes", "64x2", "--variants", "64x2"]
    assert rollout.main([*argv, "--compile-backend", "aot_eager", "--json", str(out)]) == 0
    report = json.loads(out.read_text())
    assert [(r["resolution"], r["batch"]) for r in report["rows"]] == [(64, 2)]
    [row] = report["rows"]  # the rate counts the whole rollout and the VAE decode
    assert row["images_per_s"] == pytest.approx(2 / (row["rollout_s"] + row["decode_s"]), rel=1e-12)
    variants = {v["variant"]: v for v in report["variants"]}
    assert set(variants) == {"general-eager", "query-eager", "query-compiled"}
    assert all(v["rel_diff"] < 1e-5 for v in variants.values())
    assert 0 < report["drift_tiny"]["rel_err"] < 0.05
