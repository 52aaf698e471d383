"""BAGEL-7B-MoT for text-to-image: a Mixture-of-Transformers decoder and its generation heads.

A Qwen2.5 decoder whose every per-layer weight exists twice: the understanding expert ("und",
plain names) runs the text tokens and the image markers, the generation expert ("gen", names
ending in ``_moe_gen``) runs the VAE-latent tokens. Routing is by token type, given as a boolean
``is_gen`` mask; both experts' tokens share one joint attention. Module and parameter names map
1:1 onto the published ``ema.safetensors`` keys.

Three forwards serve the sampler and the trainer:

- ``prefill``: prompts (padded, any side) run causally through the und expert into a KVCache;
- ``predict_velocity``: the image query [soi, N latents, eoi] of every row, all at RoPE position
  = that row's prompt length, non-causal, attending to the row's valid cache entries; an empty
  cache row is the text-unconditional CFG branch;
- ``forward``: the one-pass training sequence [prompt, soi, N latents, eoi], which gives the
  same velocity as prefill + predict_velocity.

RMSNorm variance, qk-norm and RoPE run in fp32 whatever the weight dtype; velocities come back
in fp32. How attention is computed, the KV cache and the query's fast attention over it live in
``attention.py``; compile, activation checkpointing and FSDP2 are applied from outside by
``parallelize.py``. Nothing here knows about parallelism, compile or checkpoint files.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import cast

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from flowgrpo.models.bagel.attention import KVCache, attend, attention_bias, query_attention
from flowgrpo.models.bagel.config import BagelConfig

# --------------------------------------------------------------------------------------------
# Latent <-> token packing
# --------------------------------------------------------------------------------------------


def patchify(latent: Tensor, patch: int = 2) -> Tensor:
    """[..., C, H, W] -> [..., (H/p) * (W/p), p * p * C]: tokens row-major, the feature of latent
    pixel (p_row, p_col) of a patch and channel c at index (p_row * p + p_col) * C + c."""
    *lead, channels, height, width = latent.shape
    if height % patch or width % patch:
        raise ValueError(f"latent {height}x{width} is not a multiple of the patch size {patch}")
    rows, cols = height // patch, width // patch
    x = latent.reshape(*lead, channels, rows, patch, cols, patch)
    n = len(lead)
    x = x.permute(*range(n), n + 1, n + 3, n + 2, n + 4, n)  # -> rows, cols, p_row, p_col, C
    return x.reshape(*lead, rows * cols, patch * patch * channels)


def unpatchify(tokens: Tensor, rows: int, cols: int, patch: int = 2) -> Tensor:
    """Inverse of ``patchify``: [..., rows * cols, p * p * C] -> [..., C, rows * p, cols * p]."""
    *lead, count, features = tokens.shape
    if count != rows * cols or features % (patch * patch):
        raise ValueError(f"{count} tokens of {features} features do not fill a {rows}x{cols} grid")
    channels = features // (patch * patch)
    x = tokens.reshape(*lead, rows, cols, patch, patch, channels)
    n = len(lead)
    x = x.permute(*range(n), n + 4, n, n + 2, n + 1, n + 3)  # -> C, rows, p_row, cols, p_col
    return x.reshape(*lead, channels, rows * patch, cols * patch)


def latent_position_ids(
    rows: int, cols: int, max_latent_size: int, device: torch.device | str | None = None
) -> Tensor:
    """Row indices into ``latent_pos_embed`` of a rows x cols token grid: r * max_latent_size + c."""
    if rows > max_latent_size or cols > max_latent_size:
        raise ValueError(f"a {rows}x{cols} token grid exceeds max_latent_size {max_latent_size}")
    r = torch.arange(rows, device=device)[:, None]
    c = torch.arange(cols, device=device)[None, :]
    return (r * max_latent_size + c).flatten()


# --------------------------------------------------------------------------------------------
# Building blocks
# --------------------------------------------------------------------------------------------


class RMSNorm(nn.Module):
    """Qwen2 RMSNorm: the variance in fp32, the result cast back to the input dtype, then scaled.
    Fed fp32 (as qk-norm is), it stays fp32."""

    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: Tensor) -> Tensor:
        x32 = x.float()
        normed = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * normed.to(x.dtype)


def rope_cos_sin(positions: Tensor, head_dim: int, theta: float) -> tuple[Tensor, Tensor]:
    """cos and sin [B, T, 1, head_dim] in fp32 of plain 1-D rotate-half RoPE at integer positions [B, T]."""
    exponents = torch.arange(0, head_dim, 2, device=positions.device, dtype=torch.float32) / head_dim
    inv_freq = 1.0 / theta**exponents
    angles = positions.float()[..., None] * inv_freq
    angles = torch.cat([angles, angles], dim=-1)[:, :, None, :]
    return angles.cos(), angles.sin()


def apply_rope(x: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
    """Rotate [B, T, heads, head_dim] by its positions (rotate-half convention)."""
    first, second = x.chunk(2, dim=-1)
    return x * cos + torch.cat([-second, first], dim=-1) * sin


class SwiGLU(nn.Module):
    def __init__(self, hidden: int, intermediate: int) -> None:
        super().__init__()
        self.gate_proj = nn.Linear(hidden, intermediate, bias=False)
        self.up_proj = nn.Linear(hidden, intermediate, bias=False)
        self.down_proj = nn.Linear(intermediate, hidden, bias=False)

    def forward(self, x: Tensor) -> Tensor:
        out: Tensor = self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))
        return out


@dataclass
class ExpertRoute:
    """Where each expert's tokens sit in a [B, T] sequence flattened to B * T rows.

    ``split`` gathers each expert's rows, ``merge`` puts them back with one gather through
    ``inverse`` (no in-place scatter, so autograd and activation checkpointing see plain ops).
    """

    und_rows: Tensor  # [n_und] long
    gen_rows: Tensor  # [n_gen] long
    inverse: Tensor  # [B * T] long: where every token lands in cat(und rows, gen rows)
    batch: int
    seq: int

    @classmethod
    def from_mask(cls, is_gen: Tensor) -> ExpertRoute:
        flat = is_gen.flatten()
        und_rows = (~flat).nonzero().squeeze(1)
        gen_rows = flat.nonzero().squeeze(1)
        order = torch.cat([und_rows, gen_rows])
        inverse = torch.empty_like(order)
        inverse[order] = torch.arange(order.numel(), device=order.device)
        return cls(und_rows, gen_rows, inverse, batch=is_gen.shape[0], seq=is_gen.shape[1])

    def split(self, x: Tensor) -> tuple[Tensor, Tensor]:
        """[B, T, *rest] -> (und rows [n_und, *rest], gen rows [n_gen, *rest])."""
        flat = x.flatten(0, 1)
        return flat.index_select(0, self.und_rows), flat.index_select(0, self.gen_rows)

    def merge(self, und: Tensor, gen: Tensor) -> Tensor:
        """Inverse of ``split``."""
        rows = torch.cat([und, gen]).index_select(0, self.inverse)
        return rows.view(self.batch, self.seq, *rows.shape[1:])


# --------------------------------------------------------------------------------------------
# The MoT decoder
# --------------------------------------------------------------------------------------------


class MoTAttention(nn.Module):
    """Both experts' q/k/v/o projections and qk-norms; the attention itself is joint (in the layer)."""

    def __init__(self, cfg: BagelConfig) -> None:
        super().__init__()
        q_dim, kv_dim = cfg.heads * cfg.head_dim, cfg.kv_heads * cfg.head_dim
        self.heads, self.kv_heads, self.head_dim = cfg.heads, cfg.kv_heads, cfg.head_dim
        self.q_proj = nn.Linear(cfg.hidden, q_dim, bias=True)
        self.k_proj = nn.Linear(cfg.hidden, kv_dim, bias=True)
        self.v_proj = nn.Linear(cfg.hidden, kv_dim, bias=True)
        self.o_proj = nn.Linear(q_dim, cfg.hidden, bias=False)
        self.q_norm = RMSNorm(cfg.head_dim, cfg.rms_eps)
        self.k_norm = RMSNorm(cfg.head_dim, cfg.rms_eps)
        self.q_proj_moe_gen = nn.Linear(cfg.hidden, q_dim, bias=True)
        self.k_proj_moe_gen = nn.Linear(cfg.hidden, kv_dim, bias=True)
        self.v_proj_moe_gen = nn.Linear(cfg.hidden, kv_dim, bias=True)
        self.o_proj_moe_gen = nn.Linear(q_dim, cfg.hidden, bias=False)
        self.q_norm_moe_gen = RMSNorm(cfg.head_dim, cfg.rms_eps)
        self.k_norm_moe_gen = RMSNorm(cfg.head_dim, cfg.rms_eps)

    def qkv(self, x: Tensor, gen: bool) -> tuple[Tensor, Tensor, Tensor]:
        """Rows [R, hidden] of one expert -> q [R, heads, D] and k [R, kv_heads, D] qk-normed in
        fp32, v [R, kv_heads, D] in the weight dtype."""
        if gen:
            q_proj, k_proj, v_proj = self.q_proj_moe_gen, self.k_proj_moe_gen, self.v_proj_moe_gen
            q_norm, k_norm = self.q_norm_moe_gen, self.k_norm_moe_gen
        else:
            q_proj, k_proj, v_proj = self.q_proj, self.k_proj, self.v_proj
            q_norm, k_norm = self.q_norm, self.k_norm
        q = q_norm(q_proj(x).unflatten(-1, (self.heads, self.head_dim)).float())
        k = k_norm(k_proj(x).unflatten(-1, (self.kv_heads, self.head_dim)).float())
        v = v_proj(x).unflatten(-1, (self.kv_heads, self.head_dim))
        return q, k, v


class MoTDecoderLayer(nn.Module):
    def __init__(self, cfg: BagelConfig) -> None:
        super().__init__()
        self.self_attn = MoTAttention(cfg)
        self.mlp = SwiGLU(cfg.hidden, cfg.intermediate)
        self.mlp_moe_gen = SwiGLU(cfg.hidden, cfg.intermediate)
        self.input_layernorm = RMSNorm(cfg.hidden, cfg.rms_eps)
        self.input_layernorm_moe_gen = RMSNorm(cfg.hidden, cfg.rms_eps)
        self.post_attention_layernorm = RMSNorm(cfg.hidden, cfg.rms_eps)
        self.post_attention_layernorm_moe_gen = RMSNorm(cfg.hidden, cfg.rms_eps)

    def forward(
        self,
        x: Tensor,
        route: ExpertRoute,
        rope: tuple[Tensor, Tensor],
        attn_bias: Tensor,
        past_kv: tuple[Tensor, Tensor] | None = None,
    ) -> tuple[Tensor, tuple[Tensor, Tensor]]:
        """x [B, T, hidden] -> (x, (k, v) [B, kv_heads, T, D] of these tokens, for a cache).
        ``past_kv`` holds S earlier tokens' K/V, already normed and rotated; ``attn_bias``
        [B, 1, T, S + T] is additive."""
        x_und, x_gen = route.split(x)
        q_und, k_und, v_und = self.self_attn.qkv(self.input_layernorm(x_und), gen=False)
        q_gen, k_gen, v_gen = self.self_attn.qkv(self.input_layernorm_moe_gen(x_gen), gen=True)

        cos, sin = rope
        q = apply_rope(route.merge(q_und, q_gen), cos, sin).to(x.dtype).transpose(1, 2)
        k = apply_rope(route.merge(k_und, k_gen), cos, sin).to(x.dtype).transpose(1, 2)
        v = route.merge(v_und, v_gen).transpose(1, 2)
        if past_kv is None:
            keys, values = k, v
        else:
            keys, values = torch.cat([past_kv[0], k], dim=2), torch.cat([past_kv[1], v], dim=2)
        out = attend(q, keys, values, attn_bias).transpose(1, 2).flatten(2)

        out_und, out_gen = route.split(out)
        x_und = x_und + self.self_attn.o_proj(out_und)
        x_gen = x_gen + self.self_attn.o_proj_moe_gen(out_gen)
        x_und = x_und + self.mlp(self.post_attention_layernorm(x_und))
        x_gen = x_gen + self.mlp_moe_gen(self.post_attention_layernorm_moe_gen(x_gen))
        return route.merge(x_und, x_gen), (k, v)

    # The image query [soi, N latents, eoi] has a static layout, so its two experts' rows are kept
    # apart for the whole forward (x_gen [B, N, hidden], x_und [B, 2, hidden]): no routing gather,
    # no host sync. Inside attention the query tokens are ordered [latents, soi, eoi]; the query is
    # non-causal and all its tokens share one RoPE position, so the order changes nothing.
    # These two methods are the per-layer work around attention; parallelize.py compiles and
    # checkpoints them and registers them as FSDP2 forwards.

    def query_qkv(
        self, x_gen: Tensor, x_und: Tensor, cos: Tensor, sin: Tensor
    ) -> tuple[Tensor, Tensor, Tensor]:
        """-> q [B, N + 2, heads, D], k and v [B, N + 2, kv_heads, D] in the weight dtype, rows
        [latents, markers]; cos/sin [B, 1, 1, D] hold each row's single query position."""
        q_gen, k_gen, v_gen = self.self_attn.qkv(self.input_layernorm_moe_gen(x_gen), gen=True)
        q_und, k_und, v_und = self.self_attn.qkv(self.input_layernorm(x_und), gen=False)
        q = apply_rope(torch.cat([q_gen, q_und], dim=1), cos, sin).to(x_gen.dtype)
        k = apply_rope(torch.cat([k_gen, k_und], dim=1), cos, sin).to(x_gen.dtype)
        return q, k, torch.cat([v_gen, v_und], dim=1)

    def query_out(self, x_gen: Tensor, x_und: Tensor, attn: Tensor) -> tuple[Tensor, Tensor]:
        """Output projection, residuals and MLPs of both experts; attn [B, N + 2, heads * D]."""
        n = x_gen.shape[1]
        x_gen = x_gen + self.self_attn.o_proj_moe_gen(attn[:, :n])
        x_und = x_und + self.self_attn.o_proj(attn[:, n:])
        x_gen = x_gen + self.mlp_moe_gen(self.post_attention_layernorm_moe_gen(x_gen))
        x_und = x_und + self.mlp(self.post_attention_layernorm(x_und))
        return x_gen, x_und


class MoTDecoder(nn.Module):
    """``language_model.model``: token embedding, the layers, and one final norm per expert."""

    def __init__(self, cfg: BagelConfig) -> None:
        super().__init__()
        self.cfg = cfg
        self.embed_tokens = nn.Embedding(cfg.vocab, cfg.hidden)
        self.layers = nn.ModuleList(MoTDecoderLayer(cfg) for _ in range(cfg.layers))
        self.norm = RMSNorm(cfg.hidden, cfg.rms_eps)
        self.norm_moe_gen = RMSNorm(cfg.hidden, cfg.rms_eps)

    def forward(
        self,
        embeds: Tensor,
        is_gen: Tensor,
        positions: Tensor,
        mask: Tensor,
        *,
        past: KVCache | None = None,
        keep_kv: bool = False,
    ) -> tuple[Tensor, list[tuple[Tensor, Tensor]]]:
        """embeds [B, T, hidden], is_gen [B, T] bool, positions [B, T] long, mask [B, 1, T, S + T]
        bool -> (final-normed hidden [B, T, hidden], each layer's (k, v) of these tokens if
        ``keep_kv`` else [])."""
        route = ExpertRoute.from_mask(is_gen)
        rope = rope_cos_sin(positions, self.cfg.head_dim, self.cfg.rope_theta)
        attn_bias = attention_bias(mask, embeds.dtype)
        x, new_kv = embeds, []
        for i, layer in enumerate(self.layers):
            past_kv = None if past is None else (past.keys[i], past.values[i])
            x, kv = layer(x, route, rope, attn_bias, past_kv)
            if keep_kv:
                new_kv.append(kv)
        x_und, x_gen = route.split(x)
        return route.merge(self.norm(x_und), self.norm_moe_gen(x_gen)), new_kv

    def forward_query(self, x_gen: Tensor, x_und: Tensor, cache: KVCache) -> Tensor:
        """The image query of every row over its cache row: latent embeddings x_gen [B, N, hidden],
        marker embeddings x_und [B, 2, hidden] (soi, eoi) -> final-normed latent hidden states
        [B, N, hidden]. Same function as ``forward`` on [soi, latents, eoi] with ``query_mask``,
        without routing gathers or host syncs."""
        positions = cache.lengths[:, None]  # one RoPE position per row: its context length
        cos, sin = rope_cos_sin(positions, self.cfg.head_dim, self.cfg.rope_theta)  # [B, 1, 1, D]
        runs = cache.query_runs()
        bias = None
        if runs is None:
            bias = attention_bias(query_mask(cache.key_mask, x_gen.shape[1] + 2), x_gen.dtype)
        for i, layer in enumerate(cast("Sequence[MoTDecoderLayer]", self.layers)):
            q, k, v = layer.query_qkv(x_gen, x_und, cos, sin)
            attn = query_attention(q, k, v, cache.keys[i], cache.values[i], runs=runs, bias=bias)
            x_gen, x_und = layer.query_out(x_gen, x_und, attn)
        return self.norm_moe_gen(x_gen)  # type: ignore[no-any-return]


class MoTLanguageModel(nn.Module):
    """``language_model``: the decoder and the (untied, unused for text-to-image) LM head."""

    def __init__(self, cfg: BagelConfig) -> None:
        super().__init__()
        self.model = MoTDecoder(cfg)
        self.lm_head = nn.Linear(cfg.hidden, cfg.vocab, bias=False)


# --------------------------------------------------------------------------------------------
# Generation heads
# --------------------------------------------------------------------------------------------


def timestep_sinusoid(t: Tensor, dim: int, max_period: float = 10000.0) -> Tensor:
    """[B] raw t in [0, 1] (not x1000) -> [B, dim] fp32: cos of the first half, sin of the second,
    frequencies exp(-ln(max_period) * i / (dim / 2))."""
    half = dim // 2
    freqs = torch.exp(-math.log(max_period) * torch.arange(half, dtype=torch.float32, device=t.device) / half)
    angles = t.float()[:, None] * freqs[None, :]
    return torch.cat([angles.cos(), angles.sin()], dim=-1)


class TimestepEmbedder(nn.Module):
    def __init__(self, hidden: int, sinusoid_dim: int) -> None:
        super().__init__()
        self.sinusoid_dim = sinusoid_dim
        self.mlp = nn.Sequential(nn.Linear(sinusoid_dim, hidden), nn.SiLU(), nn.Linear(hidden, hidden))

    def forward(self, t: Tensor) -> Tensor:
        weight_dtype = next(self.mlp.parameters()).dtype
        embedded: Tensor = self.mlp(timestep_sinusoid(t, self.sinusoid_dim).to(weight_dtype))
        return embedded


def sincos_2d_table(hidden: int, grid: int) -> Tensor:
    """[grid * grid, hidden] fp32 table, row r * grid + c: the first half of the dims encodes the
    column c, the second the row r; each half is [sin(pos w_j), cos(pos w_j)], j < hidden / 4,
    w_j = 10000 ** (-j / (hidden / 4)). Computed in float64 like the reference's numpy code."""
    quarter = hidden // 4
    omega = 1.0 / 10000.0 ** (torch.arange(quarter, dtype=torch.float64) / quarter)
    rows, cols = torch.meshgrid(torch.arange(grid), torch.arange(grid), indexing="ij")

    def encode(pos: Tensor) -> Tensor:
        angles = pos.flatten().double()[:, None] * omega[None, :]
        return torch.cat([angles.sin(), angles.cos()], dim=1)

    return torch.cat([encode(cols), encode(rows)], dim=1).float()


class PositionEmbedding(nn.Module):
    """``latent_pos_embed``: the frozen 2-D table, stored in the checkpoint as ``pos_embed``."""

    def __init__(self, max_latent_size: int, hidden: int) -> None:
        super().__init__()
        self.pos_embed = nn.Parameter(sincos_2d_table(hidden, max_latent_size), requires_grad=False)

    def forward(self, position_ids: Tensor) -> Tensor:
        return self.pos_embed[position_ids]


# --------------------------------------------------------------------------------------------
# Attention masks and positions (True = may attend)
# --------------------------------------------------------------------------------------------


def text_positions(token_mask: Tensor, start: Tensor) -> Tensor:
    """RoPE positions [B, T] of new text tokens: ``start`` [B] plus the count of earlier real
    tokens, so left and right padding give the same numbering; padding takes a neighbour's."""
    return start[:, None] + (token_mask.long().cumsum(dim=1) - 1).clamp(min=0)


def prefill_mask(token_mask: Tensor, past_mask: Tensor) -> Tensor:
    """[B, 1, T, S + T] for T new tokens after S cached ones: every real cached entry, and new
    real tokens causally. Built explicitly because SDPA's is_causal is top-left aligned. Every
    token also sees itself, so a padding row never takes a softmax over nothing."""
    t = token_mask.shape[1]
    causal = torch.ones(t, t, dtype=torch.bool, device=token_mask.device).tril()
    itself = torch.eye(t, dtype=torch.bool, device=token_mask.device)
    new = (causal[None] & token_mask[:, None, :]) | itself[None]
    past = past_mask[:, None, :].expand(-1, t, -1)
    return torch.cat([past, new], dim=2)[:, None]


def query_mask(past_mask: Tensor, query_len: int) -> Tensor:
    """[B, 1, Q, S + Q] for the image query: real cached entries and every query token."""
    b, s = past_mask.shape
    past = past_mask[:, None, :].expand(b, query_len, s)
    query = torch.ones(b, query_len, query_len, dtype=torch.bool, device=past_mask.device)
    return torch.cat([past, query], dim=2)[:, None]


def one_pass_mask(text_mask: Tensor, image_len: int) -> Tensor:
    """[B, 1, L + Q, L + Q] for [text (L, padded), image (Q)]: text rows causal among real text
    (exactly the prefill), image rows see real text and the whole image (exactly the query)."""
    b, _ = text_mask.shape
    no_past = text_mask.new_zeros(b, 0)
    text_rows = prefill_mask(text_mask, no_past)[:, 0]
    text_rows = torch.cat([text_rows, text_mask.new_zeros(b, text_rows.shape[1], image_len)], dim=2)
    image_rows = query_mask(text_mask, image_len)[:, 0]
    return torch.cat([text_rows, image_rows], dim=1)[:, None]


# --------------------------------------------------------------------------------------------
# The model
# --------------------------------------------------------------------------------------------


class BagelModel(nn.Module):
    """The BAGEL weights text-to-image needs (``vit_model``, ``connector`` and ``vit_pos_embed``
    serve image understanding and are left out)."""

    def __init__(self, cfg: BagelConfig) -> None:
        super().__init__()
        self.config = cfg
        self.language_model = MoTLanguageModel(cfg)
        self.time_embedder = TimestepEmbedder(cfg.hidden, cfg.timestep_dim)
        self.vae2llm = nn.Linear(cfg.latent_token_dim, cfg.hidden, bias=True)
        self.llm2vae = nn.Linear(cfg.hidden, cfg.latent_token_dim, bias=True)
        self.latent_pos_embed = PositionEmbedding(cfg.max_latent_size, cfg.hidden)

    @property
    def decoder(self) -> MoTDecoder:
        return self.language_model.model

    def image_query(
        self, x_t: Tensor, t: Tensor, latent_pos_ids: Tensor, *, soi_id: int, eoi_id: int
    ) -> tuple[Tensor, Tensor]:
        """Embeddings [B, N + 2, hidden] of [soi, N latents, eoi] and their is_gen mask [B, N + 2].
        A latent's embedding is vae2llm(x_t) + time_embedder(t) + latent_pos_embed[position id].
        x_t [B, N, 64] (fp32), t [B], latent_pos_ids [N] or [B, N]."""
        b, n, _ = x_t.shape
        soi, eoi = self._marker_embeddings(soi_id, eoi_id).unbind(0)
        latents = self._latent_embeddings(x_t, t, latent_pos_ids)
        embeds = torch.cat([soi.expand(b, 1, -1), latents, eoi.expand(b, 1, -1)], dim=1)
        is_gen = torch.zeros(b, n + 2, dtype=torch.bool, device=x_t.device)
        is_gen[:, 1 : n + 1] = True
        return embeds, is_gen

    def _latent_embeddings(self, x_t: Tensor, t: Tensor, latent_pos_ids: Tensor) -> Tensor:
        """vae2llm(x_t) + time_embedder(t) + latent_pos_embed[position id] -> [B, N, hidden]."""
        weight_dtype = self.vae2llm.weight.dtype
        latents: Tensor = (
            self.vae2llm(x_t.to(weight_dtype))
            + self.time_embedder(t)[:, None, :]
            + self.latent_pos_embed(latent_pos_ids)
        )
        return latents

    def _marker_embeddings(self, soi_id: int, eoi_id: int) -> Tensor:
        """[2, hidden]: the soi and eoi rows of the embedding table, indexed by Python ints (an id
        tensor would be a host-to-device copy, a sync, on every call)."""
        table = self.decoder.embed_tokens.weight
        return torch.stack([table[soi_id], table[eoi_id]])

    def prefill(self, input_ids: Tensor, token_mask: Tensor, cache: KVCache | None = None) -> KVCache:
        """Run prompts [B, L] causally through the und expert and return the cache extended with
        them. ``token_mask`` [B, L] marks real tokens (padding on either side); positions continue
        from the cache's lengths (0..L-1 for a fresh cache)."""
        b = input_ids.shape[0]
        token_mask = token_mask.bool()
        if cache is None:
            cache = KVCache.empty(self.config, b, self.vae2llm.weight.dtype, input_ids.device)
        positions = text_positions(token_mask, cache.lengths)
        mask = prefill_mask(token_mask, cache.key_mask)
        embeds = self.decoder.embed_tokens(input_ids)
        is_gen = torch.zeros_like(token_mask, dtype=torch.bool)
        _, new_kv = self.decoder(embeds, is_gen, positions, mask, past=cache, keep_kv=True)
        return cache.extend(new_kv, token_mask)

    def predict_velocity(
        self, cache: KVCache, x_t: Tensor, t: Tensor, latent_pos_ids: Tensor, *, soi_id: int, eoi_id: int
    ) -> Tensor:
        """Velocity [B, N, 64] fp32 of latents x_t [B, N, 64] at times t [B], each row conditioned on
        its cache row (an empty row = the text-unconditional branch). The N + 2 query tokens sit at
        RoPE position = the row's cache length and see each other and the row's real entries."""
        b = x_t.shape[0]
        x_gen = self._latent_embeddings(x_t, t, latent_pos_ids)
        # contiguous like every later layer's x_und: one layout, one compiled graph (parallelize.py)
        x_und = self._marker_embeddings(soi_id, eoi_id).expand(b, 2, -1).contiguous()
        hidden = self.decoder.forward_query(x_gen, x_und, cache)
        velocity: Tensor = self.llm2vae(hidden)
        return velocity.float()

    def forward(
        self,
        input_ids: Tensor,
        token_mask: Tensor,
        x_t: Tensor,
        t: Tensor,
        latent_pos_ids: Tensor,
        *,
        soi_id: int,
        eoi_id: int,
    ) -> Tensor:
        """The one-pass (training) velocity [B, N, 64] fp32 over [prompt (L, padded), soi, N latents,
        eoi]: text at positions 0..len-1, causal; image rows at position len, seeing all real text
        and the whole image. Equals prefill + predict_velocity up to float rounding."""
        b, text_len = input_ids.shape
        n = x_t.shape[1]
        token_mask = token_mask.bool()
        image, image_is_gen = self.image_query(x_t, t, latent_pos_ids, soi_id=soi_id, eoi_id=eoi_id)
        embeds = torch.cat([self.decoder.embed_tokens(input_ids), image], dim=1)
        is_gen = torch.cat([torch.zeros_like(token_mask, dtype=torch.bool), image_is_gen], dim=1)
        lengths = token_mask.sum(dim=1)
        no_start = torch.zeros_like(lengths)
        positions = torch.cat(
            [text_positions(token_mask, no_start), lengths[:, None].expand(b, n + 2)], dim=1
        )
        mask = one_pass_mask(token_mask, n + 2)
        hidden, _ = self.decoder(embeds, is_gen, positions, mask)
        velocity: Tensor = self.llm2vae(hidden[:, text_len + 1 : text_len + 1 + n])
        return velocity.float()

    @torch.no_grad()
    def init_weights(self, std: float = 0.02, generator: torch.Generator | None = None) -> None:
        """Random weights for a model built on the meta device and moved with ``to_empty``:
        normal linears and embeddings, zero biases, unit norms, the exact sin-cos table."""
        for module in self.modules():
            if isinstance(module, nn.Linear | nn.Embedding):
                module.weight.normal_(0.0, std, generator=generator)
            if isinstance(module, nn.Linear) and module.bias is not None:
                module.bias.zero_()
            if isinstance(module, RMSNorm):
                module.weight.fill_(1.0)
        table = sincos_2d_table(self.config.hidden, self.config.max_latent_size)
        self.latent_pos_embed.pos_embed.copy_(table)
