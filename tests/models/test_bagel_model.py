"""The BAGEL MoT model on the tiny config (CPU, fp32): packing, heads against their formulas, the
three forwards against each other and against a naive per-token reference, batching, the 7B size.
Each test says whether it expects bitwise equality or a tolerance."""

from __future__ import annotations

import math
from collections.abc import Callable

import pytest
import torch
from torch import Tensor

from flowgrpo.models.bagel.attention import KVCache
from flowgrpo.models.bagel.config import bagel_7b, tiny
from flowgrpo.models.bagel.model import (
    BagelModel,
    MoTDecoderLayer,
    latent_position_ids,
    patchify,
    timestep_sinusoid,
    unpatchify,
)

SOI, EOI = 386, 387  # any ids below the tiny vocabulary
MARKERS = {"soi_id": SOI, "eoi_id": EOI}
ROWS = COLS = 4  # a 4x4 token grid: 64x64 pixels
N = ROWS * COLS


def assert_fp32_close(actual: Tensor, expected: Tensor) -> None:
    """The tolerance of fp32 rounding in reordered sums."""
    torch.testing.assert_close(actual, expected, atol=2e-5, rtol=2e-5)


@pytest.fixture(scope="module")
def model() -> BagelModel:
    torch.manual_seed(0)
    return BagelModel(tiny()).eval()


def prompts(lengths: list[int], left_pad: bool = False, seed: int = 1) -> tuple[Tensor, Tensor]:
    """Random ids [B, max len] and the real-token mask, padded right (or left) with id 0."""
    g = torch.Generator().manual_seed(seed)
    width = max(lengths)
    ids = torch.zeros(len(lengths), width, dtype=torch.long)
    mask = torch.zeros(len(lengths), width, dtype=torch.bool)
    for row, n in enumerate(lengths):
        cols = slice(width - n, width) if left_pad else slice(0, n)
        ids[row, cols] = torch.randint(1, 380, (n,), generator=g)
        mask[row, cols] = True
    return ids, mask


def latents(batch: int, seed: int = 2) -> tuple[Tensor, Tensor]:
    g = torch.Generator().manual_seed(seed)
    return torch.randn(batch, N, 64, generator=g), torch.rand(batch, generator=g)


def pos_ids() -> Tensor:
    return latent_position_ids(ROWS, COLS, tiny().max_latent_size)


# --------------------------------------------------------------------------------------------
# Packing and positions
# --------------------------------------------------------------------------------------------


def test_patchify_feature_order_and_round_trip() -> None:
    """Bitwise: token (r, c) holds latent[ch, 2r + p, 2c + q] at feature (2p + q) * 16 + ch."""
    latent = torch.randn(2, 16, 6, 8)
    tokens = patchify(latent)
    assert tokens.shape == (2, 12, 64)
    for r, c, p, q, ch in [(0, 0, 0, 0, 0), (1, 2, 0, 1, 5), (2, 3, 1, 0, 15), (2, 1, 1, 1, 7)]:
        assert tokens[1, r * 4 + c, (2 * p + q) * 16 + ch] == latent[1, ch, 2 * r + p, 2 * c + q]
    assert torch.equal(unpatchify(tokens, 3, 4), latent)
    assert torch.equal(unpatchify(patchify(latent[0]), 3, 4), latent[0])  # no batch dim


def test_latent_position_ids_index_the_table_row_major() -> None:
    """Bitwise: r * max_latent_size + c, row-major; a grid larger than the table is refused."""
    assert latent_position_ids(2, 3, 8).tolist() == [0, 1, 2, 8, 9, 10]
    with pytest.raises(ValueError, match="max_latent_size"):
        latent_position_ids(9, 1, 8)


# --------------------------------------------------------------------------------------------
# Generation heads against their formulas
# --------------------------------------------------------------------------------------------


def test_time_embedding_matches_formula(model: BagelModel) -> None:
    """Tolerance 1e-6 (fp32 vs float64 formula): 256 dims, first 128 cos, last 128 sin of the
    RAW t times exp(-ln(10000) i / 128); then Linear -> SiLU -> Linear (bitwise)."""
    t = torch.tensor([0.0, 0.25, 0.7311, 1.0])
    expected = torch.tensor(
        [
            [math.cos(ti * math.exp(-math.log(10000) * i / 128)) for i in range(128)]
            + [math.sin(ti * math.exp(-math.log(10000) * i / 128)) for i in range(128)]
            for ti in t.tolist()
        ]
    )
    sinusoid = timestep_sinusoid(t, 256)
    torch.testing.assert_close(sinusoid, expected.float(), atol=1e-6, rtol=0)
    mlp = model.time_embedder.mlp
    manual = mlp[2](torch.nn.functional.silu(mlp[0](sinusoid)))
    assert torch.equal(model.time_embedder(t), manual)


def test_position_table_matches_formula(model: BagelModel) -> None:
    """Tolerance 1e-6: row r * S + c; dims [0, H/2) encode the column, [H/2, H) the row; each half
    is [sin(pos w_j), cos(pos w_j)] for j < H/4, w_j = 10000^(-j / (H/4))."""
    hidden, size = model.config.hidden, model.config.max_latent_size
    quarter = hidden // 4
    w = [10000 ** (-j / quarter) for j in range(quarter)]
    expected = torch.zeros(size * size, hidden, dtype=torch.float64)
    for r in range(size):
        for c in range(size):
            expected[r * size + c] = torch.tensor(
                [math.sin(c * wj) for wj in w]
                + [math.cos(c * wj) for wj in w]
                + [math.sin(r * wj) for wj in w]
                + [math.cos(r * wj) for wj in w]
            )
    table = model.latent_pos_embed.pos_embed
    assert not table.requires_grad
    torch.testing.assert_close(table, expected.float(), atol=1e-6, rtol=0)


# --------------------------------------------------------------------------------------------
# The forwards
# --------------------------------------------------------------------------------------------


@torch.no_grad()
def test_cache_query_equals_one_pass_with_both_cfg_branches(model: BagelModel) -> None:
    """Tolerance (fp32): 4 prompts of different lengths plus 2 text-unconditional rows (empty
    cache, query at position 0) in ONE query forward == the one-pass forward; left padding ==
    right padding."""
    lengths = [5, 9, 2, 7]
    ids, mask = prompts(lengths)
    x, t = latents(6)
    cond = model.prefill(ids, mask)
    assert cond.lengths.tolist() == lengths
    cache = KVCache.cat_rows([cond, KVCache.empty(model.config, 2, torch.float32, "cpu")])
    v = model.predict_velocity(cache, x, t, pos_ids(), **MARKERS)
    assert v.shape == (6, N, 64) and v.dtype == torch.float32

    # One pass: the unconditional rows are prompts with no real token.
    ids6 = torch.cat([ids, torch.zeros(2, ids.shape[1], dtype=torch.long)])
    mask6 = torch.cat([mask, torch.zeros(2, ids.shape[1], dtype=torch.bool)])
    assert_fp32_close(model(ids6, mask6, x, t, pos_ids(), **MARKERS), v)
    empty_prompt = torch.zeros(2, 0, dtype=torch.long)
    assert_fp32_close(model(empty_prompt, empty_prompt.bool(), x[4:], t[4:], pos_ids(), **MARKERS), v[4:])

    left_ids, left_mask = prompts(lengths, left_pad=True)
    left = model.predict_velocity(model.prefill(left_ids, left_mask), x[:4], t[:4], pos_ids(), **MARKERS)
    assert_fp32_close(left, v[:4])
    assert not torch.allclose(v[0], v[4], atol=1e-3)  # the prompt matters


@torch.no_grad()
def test_batched_equals_one_at_a_time(model: BagelModel) -> None:
    """Tolerance: each row alone (unpadded) == its row in a padded batch, a permuted batch gives
    the permuted velocities, duplicated rows the same ones. Not bitwise: a BLAS may sum a row in
    another order by where it sits in the batch (MKL's AVX2 kernels do, by the row's alignment in
    memory; its AVX-512 ones do not), so row independence is asserted to fp32 rounding."""
    lengths = [3, 8, 1, 6]
    ids, mask = prompts(lengths)
    x, t = latents(4)
    cache = model.prefill(ids, mask)
    v = model.predict_velocity(cache, x, t, pos_ids(), **MARKERS)
    for row, n in enumerate(lengths):
        alone = model.prefill(ids[row : row + 1, :n], mask[row : row + 1, :n])
        v_row = model.predict_velocity(alone, x[row : row + 1], t[row : row + 1], pos_ids(), **MARKERS)
        assert_fp32_close(v_row[0], v[row])

    perm = torch.tensor([2, 0, 3, 1])
    permuted = model.predict_velocity(cache.select(perm), x[perm], t[perm], pos_ids(), **MARKERS)
    assert_fp32_close(permuted, v[perm])
    same = torch.tensor([1, 1, 1, 1])
    repeated = model.predict_velocity(cache.select(same), x[same], t[same], pos_ids(), **MARKERS)
    for i in range(1, 4):
        assert_fp32_close(repeated[i], repeated[0])


@torch.no_grad()
def test_prefill_continues_a_non_empty_cache(model: BagelModel) -> None:
    """Tolerance: prefilling in two chunks (the second on a non-empty cache; row 1 is padded in the
    first chunk and all padding in the second) == one prefill, positions continuing per row."""
    ids, mask = prompts([6, 2, 7])
    whole = model.prefill(ids, mask)
    first = model.prefill(ids[:, :3], mask[:, :3])
    both = model.prefill(ids[:, 3:], mask[:, 3:], cache=first)
    assert both.lengths.tolist() == [6, 2, 7]
    x, t = latents(3)
    assert_fp32_close(
        model.predict_velocity(both, x, t, pos_ids(), **MARKERS),
        model.predict_velocity(whole, x, t, pos_ids(), **MARKERS),
    )


@torch.no_grad()
def test_text_cache_uses_only_the_und_expert() -> None:
    """Bitwise: the prompt cache does not depend on any ``_moe_gen`` weight; the velocity does."""
    torch.manual_seed(3)
    model = BagelModel(tiny()).eval()
    ids, mask = prompts([4, 6])
    x, t = latents(2)
    cache = model.prefill(ids, mask)
    v = model.predict_velocity(cache, x, t, pos_ids(), **MARKERS)
    for name, param in model.named_parameters():
        if "moe_gen" in name:
            param.add_(0.1)
    again = model.prefill(ids, mask)
    assert all(
        torch.equal(a, b) for a, b in zip(cache.keys + cache.values, again.keys + again.values, strict=True)
    )
    assert not torch.allclose(model.predict_velocity(again, x, t, pos_ids(), **MARKERS), v, atol=1e-3)


def reference_velocity(model: BagelModel, ids: list[int], x: Tensor, t: float) -> Tensor:
    """A naive single-sample BAGEL forward over [prompt, soi, latents, eoi], written from SPEC
    sections 1-2 with explicit per-token expert choice, RoPE angles and masked softmax."""
    cfg, sd = model.config, model.state_dict()
    group = cfg.heads // cfg.kv_heads

    def rms(v: Tensor, weight: Tensor) -> Tensor:
        return weight * v / torch.sqrt(v.pow(2).mean(-1, keepdim=True) + cfg.rms_eps)

    def linear(v: Tensor, name: str, bias: bool = False) -> Tensor:
        out: Tensor = v @ sd[name + ".weight"].T
        return out + sd[name + ".bias"] if bias else out

    def rotate(v: Tensor, pos: int) -> Tensor:  # v [heads, D]
        half = cfg.head_dim // 2
        angle = torch.tensor([pos * cfg.rope_theta ** (-2 * i / cfg.head_dim) for i in range(half)])
        a, b = v[:, :half], v[:, half:]
        return torch.cat([a * angle.cos() - b * angle.sin(), b * angle.cos() + a * angle.sin()], dim=1)

    embed = sd["language_model.model.embed_tokens.weight"]
    text_len = len(ids)
    sinusoid = timestep_sinusoid(torch.tensor([t]), cfg.timestep_dim)
    time = linear(
        torch.nn.functional.silu(linear(sinusoid, "time_embedder.mlp.0", True)), "time_embedder.mlp.2", True
    )
    lat = linear(x, "vae2llm", True) + time + sd["latent_pos_embed.pos_embed"][pos_ids()]
    h = torch.cat([embed[ids], embed[[SOI]], lat, embed[[EOI]]])
    is_gen = [False] * (text_len + 1) + [True] * N + [False]
    positions = list(range(text_len)) + [text_len] * (N + 2)
    total = len(is_gen)
    sees = torch.tensor([[j <= i if i < text_len else True for j in range(total)] for i in range(total)])
    sees[:text_len, text_len:] = False

    for layer in range(cfg.layers):
        p = f"language_model.model.layers.{layer}."
        q = torch.zeros(total, cfg.heads, cfg.head_dim)
        k = torch.zeros(total, cfg.kv_heads, cfg.head_dim)
        v = torch.zeros(total, cfg.kv_heads, cfg.head_dim)
        for i in range(total):
            s = "_moe_gen" if is_gen[i] else ""
            a = rms(h[i], sd[f"{p}input_layernorm{s}.weight"])
            qi = linear(a, f"{p}self_attn.q_proj{s}", True).view(cfg.heads, -1)
            ki = linear(a, f"{p}self_attn.k_proj{s}", True).view(cfg.kv_heads, -1)
            q[i] = rotate(rms(qi, sd[f"{p}self_attn.q_norm{s}.weight"]), positions[i])
            k[i] = rotate(rms(ki, sd[f"{p}self_attn.k_norm{s}.weight"]), positions[i])
            v[i] = linear(a, f"{p}self_attn.v_proj{s}", True).view(cfg.kv_heads, -1)
        out = torch.zeros(total, cfg.heads, cfg.head_dim)
        for head in range(cfg.heads):
            scores = q[:, head] @ k[:, head // group].T / math.sqrt(cfg.head_dim)
            scores = scores.masked_fill(~sees, float("-inf"))
            out[:, head] = scores.softmax(-1) @ v[:, head // group]
        new_h = torch.zeros_like(h)
        for i in range(total):
            s = "_moe_gen" if is_gen[i] else ""
            r = h[i] + linear(out[i].flatten(), f"{p}self_attn.o_proj{s}")
            m = rms(r, sd[f"{p}post_attention_layernorm{s}.weight"])
            gate = torch.nn.functional.silu(linear(m, f"{p}mlp{s}.gate_proj"))
            new_h[i] = r + linear(gate * linear(m, f"{p}mlp{s}.up_proj"), f"{p}mlp{s}.down_proj")
        h = new_h
    final = rms(h[text_len + 1 : text_len + 1 + N], sd["language_model.model.norm_moe_gen.weight"])
    velocity: Tensor = linear(final, "llm2vae", True)
    return velocity


@torch.no_grad()
def test_matches_naive_reference(model: BagelModel) -> None:
    """Tolerance (fp32): routing, qk-norm, RoPE, GQA, masks and heads against a per-token
    re-derivation, for the cache + query path and the one-pass path."""
    ids, mask = prompts([5])
    x, t = latents(1)
    expected = reference_velocity(model, ids[0].tolist(), x[0], float(t[0]))
    cached = model.predict_velocity(model.prefill(ids, mask), x, t, pos_ids(), **MARKERS)
    assert_fp32_close(cached[0], expected)
    assert_fp32_close(model(ids, mask, x, t, pos_ids(), **MARKERS)[0], expected)


def test_one_pass_backward_reaches_both_experts_not_the_table() -> None:
    """Gradients flow into gen and und weights (und through the prompt's K/V); the frozen position
    table gets none; a frozen und path still trains the gen path."""
    torch.manual_seed(4)
    model = BagelModel(tiny())
    ids, mask = prompts([3, 5])
    x, t = latents(2)

    def loss() -> torch.Tensor:
        return model(ids, mask, x, t, pos_ids(), **MARKERS).square().mean()

    loss().backward()
    layer = model.language_model.model.layers[0]
    assert isinstance(layer, MoTDecoderLayer)
    for weight in (layer.self_attn.q_proj_moe_gen.weight, layer.self_attn.k_proj.weight):
        assert_gradient_matches_finite_difference(weight, loss)
    assert model.latent_pos_embed.pos_embed.grad is None

    model.zero_grad(set_to_none=True)
    for name, param in model.named_parameters():
        param.requires_grad_("moe_gen" in name)
    loss().backward()
    assert_gradient_matches_finite_difference(layer.mlp_moe_gen.down_proj.weight, loss)
    assert layer.mlp.down_proj.weight.grad is None


def assert_gradient_matches_finite_difference(
    weight: torch.nn.Parameter, loss: Callable[[], torch.Tensor], eps: float = 1e-2
) -> None:
    """The autograd gradient of the entry where it is largest equals the central difference
    (L(w + eps) - L(w - eps)) / 2 eps, and is not zero: a gradient that exists but is zero, or
    reaches the wrong weights, fails here."""
    assert weight.grad is not None
    index = int(weight.grad.abs().argmax())
    analytic = float(weight.grad.flatten()[index])
    assert analytic != 0.0
    with torch.no_grad():
        flat = weight.view(-1)
        flat[index] += eps
        up = float(loss())
        flat[index] -= 2 * eps
        down = float(loss())
        flat[index] += eps
    assert (up - down) / (2 * eps) == pytest.approx(analytic, rel=1e-2)


@torch.no_grad()
def test_bf16_weights_give_fp32_velocities_near_fp32(model: BagelModel) -> None:
    """Loose tolerance: bf16 weights (norms, qk-norm, RoPE still fp32) stay near the fp32 model."""
    bf16 = BagelModel(model.config).eval()
    bf16.load_state_dict(model.state_dict())
    bf16.to(torch.bfloat16)
    ids, mask = prompts([4, 7])
    x, t = latents(2)
    ref = model.predict_velocity(model.prefill(ids, mask), x, t, pos_ids(), **MARKERS)
    out = bf16.predict_velocity(bf16.prefill(ids, mask), x, t, pos_ids(), **MARKERS)
    assert out.dtype == torch.float32
    assert ((out - ref).norm() / ref.norm()).item() < 0.05


def test_7b_preset_parameter_counts() -> None:
    """Exact counts on the meta device: gen-expert matmul parameters 6.525e9 (SPEC section 7); all
    stored BAGEL weights text-to-image loads ~14.17e9 (SPEC's 14.6e9 also counts the ~0.43e9 ViT
    and connector, which are not built here)."""
    with torch.device("meta"):
        model = BagelModel(bagel_7b())
    gen_matmul = sum(
        p.numel()
        for name, p in model.named_parameters()
        if "moe_gen" in name and "_proj" in name and name.endswith(".weight")
    )
    assert gen_matmul == 28 * (2 * 3584 * 3584 + 2 * 3584 * 512 + 3 * 3584 * 18944) == 6_525_288_448
    total = sum(p.numel() for p in model.parameters())
    assert 14.1e9 < total < 14.25e9
    assert model.latent_pos_embed.pos_embed.shape == (64 * 64, 3584)
