"""How the MoT decoder attends: one masked SDPA call over a whole sequence, and the image query's
fast path over a KV cache of prompts.

- ``attend`` (with ``attention_bias``): softmax attention under an additive bias, GQA heads
  repeated; the general path of every forward.
- ``KVCache``: per-layer keys (after qk-norm and RoPE) and values of a batch of contexts of
  different lengths, built by ``BagelModel.prefill`` and shared by every denoising step.
- ``query_runs`` / ``query_attention``: the image query attends to its cache row and to itself.
  Rows whose real entries are a prefix are grouped into runs of equal length, each one unmasked
  SDPA call with GQA inside (flash / cuDNN kernels); a cache that does not cut into few runs takes
  one masked ``attend`` call instead.

Nothing here holds weights; ``model.py`` calls these from its layers.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F
from torch import Tensor

from flowgrpo.models.bagel.config import BagelConfig

# --------------------------------------------------------------------------------------------
# Masked attention (the general path)
# --------------------------------------------------------------------------------------------


def attention_bias(mask: Tensor, dtype: torch.dtype) -> Tensor:
    """Boolean mask (True = may attend) -> additive bias (0 / -inf), built once per forward rather
    than by SDPA in every layer."""
    return torch.zeros(mask.shape, dtype=dtype, device=mask.device).masked_fill_(~mask, float("-inf"))


def attend(q: Tensor, k: Tensor, v: Tensor, bias: Tensor) -> Tensor:
    """Softmax attention of q [B, heads, T, D] over k, v [B, kv_heads, S, D] with an additive bias
    [B, 1, T, S]. K/V heads are repeated explicitly (GQA) rather than through SDPA's enable_gqa:
    the kernels that take a mask do not all accept grouped heads."""
    groups = q.shape[1] // k.shape[1]
    if groups > 1:
        k = k.repeat_interleave(groups, dim=1)
        v = v.repeat_interleave(groups, dim=1)
    return F.scaled_dot_product_attention(q, k, v, attn_mask=bias)


# --------------------------------------------------------------------------------------------
# The KV cache
# --------------------------------------------------------------------------------------------


@dataclass
class KVCache:
    """Per-layer keys and values of a batch of contexts, K stored after qk-norm and RoPE.

    Rows may hold different numbers of real tokens: ``key_mask`` says which entries are real.
    A row's next RoPE position is its count of real tokens (prefill numbers tokens that way).
    """

    keys: list[Tensor]  # per layer [B, kv_heads, S, head_dim]
    values: list[Tensor]  # per layer [B, kv_heads, S, head_dim]
    key_mask: Tensor  # [B, S] bool
    # query_runs(key_mask), computed on first use: a cache serves every denoising step, and the
    # host copy of its mask is then made once, not once per step.
    _runs: list[QueryRun] | None = field(default=None, init=False, repr=False, compare=False)
    _runs_known: bool = field(default=False, init=False, repr=False, compare=False)
    _own: dict[tuple[int, ...], KVCache] = field(default_factory=dict, init=False, repr=False, compare=False)

    @property
    def lengths(self) -> Tensor:
        """[B] long: real tokens per row, the RoPE position of the row's next token."""
        return self.key_mask.sum(dim=1)

    def query_runs(self) -> list[QueryRun] | None:
        """``query_runs`` of this cache's mask (memoised; the mask must not be changed in place)."""
        if not self._runs_known:
            self._runs, self._runs_known = query_runs(self.key_mask), True
        return self._runs

    def with_host_mask(self, host_mask: Tensor) -> KVCache:
        """This cache with its :meth:`query_runs` taken from ``host_mask``, a CPU tensor equal to
        ``key_mask`` that the caller built from lengths it knows on the host: no device read (the
        branched sampler builds a context per row layout inside its loop)."""
        self._runs, self._runs_known = query_runs(host_mask), True
        return self

    @classmethod
    def empty(cls, cfg: BagelConfig, batch: int, dtype: torch.dtype, device: torch.device | str) -> KVCache:
        """A cache of ``batch`` rows with no entries: the text-unconditional CFG context."""
        shape = (batch, cfg.kv_heads, 0, cfg.head_dim)
        return cls(
            keys=[torch.zeros(shape, dtype=dtype, device=device) for _ in range(cfg.layers)],
            values=[torch.zeros(shape, dtype=dtype, device=device) for _ in range(cfg.layers)],
            key_mask=torch.zeros(batch, 0, dtype=torch.bool, device=device),
        )

    def select(self, rows: Tensor) -> KVCache:
        """The rows ``rows`` (repeats allowed: one prefilled prompt serves its G samples)."""
        return KVCache(
            keys=[k.index_select(0, rows) for k in self.keys],
            values=[v.index_select(0, rows) for v in self.values],
            key_mask=self.key_mask.index_select(0, rows),
        )

    def own_rows(self, rows: tuple[int, ...]) -> KVCache:
        """The rows ``rows`` cut to their own length (:meth:`trimmed`), memoised like
        :meth:`query_runs`: a batch-invariant forward takes each sample's rows at every step,
        and reads the lengths from the device once per sample, not once per step."""
        if rows not in self._own:
            index = torch.tensor(rows, device=self.key_mask.device)
            self._own[rows] = self.select(index).trimmed()
        return self._own[rows]

    def trimmed(self) -> KVCache:
        """This cache cut to its longest row's real entries (rows are right-padded): the padding
        another batch's longer prompt added is gone, so the row's attention is its own."""
        length = int(self.lengths.max()) if self.key_mask.shape[0] else 0
        return KVCache(
            keys=[k[:, :, :length] for k in self.keys],
            values=[v[:, :, :length] for v in self.values],
            key_mask=self.key_mask[:, :length],
        )

    @classmethod
    def cat_rows(cls, caches: Sequence[KVCache]) -> KVCache:
        """Stack caches along the batch, padding every one to the longest with masked entries
        (how the conditional and the empty unconditional contexts share one forward)."""
        longest = max(c.key_mask.shape[1] for c in caches)

        def pad(x: Tensor, dim: int) -> Tensor:
            extra = longest - x.shape[dim]
            return F.pad(x, (0, 0) * (x.dim() - 1 - dim) + (0, extra)) if extra else x

        layers = range(len(caches[0].keys))
        return cls(
            keys=[torch.cat([pad(c.keys[i], 2) for c in caches]) for i in layers],
            values=[torch.cat([pad(c.values[i], 2) for c in caches]) for i in layers],
            key_mask=torch.cat([pad(c.key_mask, 1) for c in caches]),
        )

    def extend(self, new_kv: Sequence[tuple[Tensor, Tensor]], token_mask: Tensor) -> KVCache:
        """This cache followed by freshly computed entries (valid where ``token_mask``)."""
        return KVCache(
            keys=[torch.cat([old, k], dim=2) for old, (k, _) in zip(self.keys, new_kv, strict=True)],
            values=[torch.cat([old, v], dim=2) for old, (_, v) in zip(self.values, new_kv, strict=True)],
            key_mask=torch.cat([self.key_mask, token_mask], dim=1),
        )


# --------------------------------------------------------------------------------------------
# The image query's attention over the cache
# --------------------------------------------------------------------------------------------

# At most this many SDPA calls per layer for one query batch; beyond it one masked call is cheaper
# than many small launches.
MAX_QUERY_RUNS = 16


@dataclass(frozen=True)
class QueryRun:
    """Consecutive cache rows [start, stop) whose real entries are exactly their first ``length``."""

    start: int
    stop: int
    length: int


def query_runs(key_mask: Tensor) -> list[QueryRun] | None:
    """Cut the cache rows into runs that attend without a mask (a prefix of ``length`` real keys,
    then the query), or None when a row is not a prefix (left padding) or when there would be more
    than MAX_QUERY_RUNS runs. One host copy of the mask, done once per cache."""
    mask = key_mask.cpu()
    lengths = mask.sum(dim=1)
    if not torch.equal(mask, torch.arange(mask.shape[1]) < lengths[:, None]):
        return None
    runs: list[QueryRun] = []
    for row, length in enumerate(lengths.tolist()):
        if runs and runs[-1].length == length:
            runs[-1] = QueryRun(runs[-1].start, row + 1, length)
        else:
            runs.append(QueryRun(row, row + 1, length))
    return runs if len(runs) <= MAX_QUERY_RUNS else None


def query_attention(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    past_k: Tensor,
    past_v: Tensor,
    *,
    runs: list[QueryRun] | None,
    bias: Tensor | None,
) -> Tensor:
    """Joint attention of the image query: q [B, T, heads, D] and k, v [B, T, kv_heads, D] (this
    query's tokens) over the cache rows' keys past_k, past_v [B, kv_heads, S, D] and the query's
    own -> [B, T, heads * D].

    With ``runs`` every SDPA call is unmasked and grouped (GQA inside SDPA), which lets it pick the
    flash / cuDNN kernels; otherwise one call with the additive ``bias`` [B, 1, T, S + T]."""
    if runs is None:
        assert bias is not None
        keys = torch.cat([past_k, k.transpose(1, 2)], dim=2)
        values = torch.cat([past_v, v.transpose(1, 2)], dim=2)
        return attend(q.transpose(1, 2), keys, values, bias).transpose(1, 2).flatten(2)
    outs = []
    for run in runs:
        rows = slice(run.start, run.stop)
        keys, values = k[rows].transpose(1, 2), v[rows].transpose(1, 2)
        if run.length:  # the cache's real entries come first; they are copied once per layer and step
            keys = torch.cat([past_k[rows, :, : run.length], keys], dim=2)
            values = torch.cat([past_v[rows, :, : run.length], values], dim=2)
        out = F.scaled_dot_product_attention(q[rows].transpose(1, 2), keys, values, enable_gqa=True)
        outs.append(out.transpose(1, 2))
    return (outs[0] if len(outs) == 1 else torch.cat(outs)).flatten(2)
