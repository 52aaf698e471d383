"""FLOPs of a FlowGRPO training step (SPEC section 7, matmuls actually executed), for the trainer
benchmark's MFU (``flowgrpo bench trainer``).

Per row = one CFG branch of one trajectory at one window step, T = N + 2 query tokens,
K = T + the row's context (prompt length; 0 for the empty text-unconditional context),
P = gen-expert matmul parameters (6.525e9), L layers, r = LoRA rank, S = sum over the adapted
modules of one layer of (in + out):

- forward            F  = 2 P T + 4 T K d H L  (the SPEC count) + 2 T r S L  (the LoRA matmuls);
- activation grads   Fa = 2 T (P - P_qkv0) + 2 x 4 T K d H L (dQ, dK, dV: four matmuls the size of
                         the forward's two) + LoRA: 2 T r S L - 2 T r S_qkv (layer 0's q/k/v take
                         an input without gradient: no dX there, for the base or the LoRA A);
- weight grads       Fw = 2 T r S L (LoRA dA, dB) | 2 T P (full gen path).

logp_old pass: rows x F; update pass: rows x (F + Fa + Fw); rows = trajectories x 2 (CFG) x W.
The recompute of activation checkpointing (the forward's matmuls without attention, again) and
the prompt prefill are not counted (``hfu`` adds the recompute).

The benchmark's MFU comes from :func:`counted_flops`: the same per-row formula over the rows
each variant's step actually ran (any algorithm); :func:`pass_flops` and :func:`nft_pass_flops`
write FlowGRPO's and DiffusionNFT's passes out from the settings, which the counted figures
must equal (tests/bench/test_trainer.py).
"""

from __future__ import annotations

from dataclasses import dataclass

from flowgrpo.models.bagel.config import BagelConfig
from flowgrpo.services.bench.common import gen_matmul_params

QKV = ("self_attn.q_proj_moe_gen", "self_attn.k_proj_moe_gen", "self_attn.v_proj_moe_gen")


def module_shapes(cfg: BagelConfig) -> dict[str, tuple[int, int]]:
    """(in, out) of every gen-path linear of one layer, by LoRA target name."""
    q_dim, kv_dim = cfg.heads * cfg.head_dim, cfg.kv_heads * cfg.head_dim
    return {
        "self_attn.q_proj_moe_gen": (cfg.hidden, q_dim),
        "self_attn.k_proj_moe_gen": (cfg.hidden, kv_dim),
        "self_attn.v_proj_moe_gen": (cfg.hidden, kv_dim),
        "self_attn.o_proj_moe_gen": (q_dim, cfg.hidden),
        "mlp_moe_gen.gate_proj": (cfg.hidden, cfg.intermediate),
        "mlp_moe_gen.up_proj": (cfg.hidden, cfg.intermediate),
        "mlp_moe_gen.down_proj": (cfg.intermediate, cfg.hidden),
    }


def lora_parameters(cfg: BagelConfig, rank: int, targets: list[str]) -> int:
    shapes = module_shapes(cfg)
    return cfg.layers * rank * sum(sum(shapes[t]) for t in targets)


@dataclass(frozen=True)
class RowFlops:
    """FLOPs of one row (one CFG branch of one trajectory at one window step)."""

    forward: float  # F: base + attention + LoRA forward matmuls
    act_grad: float  # Fa
    weight_grad: float  # Fw
    recompute: float  # activation checkpointing's second forward (no attention), not in MFU


def row_flops(
    cfg: BagelConfig, latent_tokens: int, context: int, *, kind: str, rank: int, targets: list[str]
) -> RowFlops:
    t = latent_tokens + 2
    k = context + t
    p = gen_matmul_params(cfg)
    shapes = module_shapes(cfg)
    p_qkv = sum(shapes[m][0] * shapes[m][1] for m in QKV)
    attn = 4.0 * t * k * cfg.head_dim * cfg.heads * cfg.layers
    lora_s = sum(sum(shapes[m]) for m in targets) if kind == "lora" else 0
    lora_s_qkv = sum(shapes[m][0] for m in targets if m in QKV) if kind == "lora" else 0  # A's input dims
    lora = 2.0 * t * rank * lora_s * cfg.layers
    forward = 2.0 * p * t + attn + lora
    act = 2.0 * t * (p - p_qkv) + 2.0 * attn + (lora - 2.0 * t * rank * lora_s_qkv)
    weight = lora if kind == "lora" else 2.0 * p * t
    return RowFlops(forward, act, weight, recompute=2.0 * p * t + lora)


def pass_flops(
    cfg: BagelConfig,
    latent_tokens: int,
    prompt_lengths: list[int],
    window: int,
    *,
    kind: str,
    rank: int,
    targets: list[str],
) -> dict[str, float]:
    """FLOPs of one training step over trajectories whose prompts have ``prompt_lengths`` tokens:
    both CFG branches (conditional: the prompt as context; unconditional: none) at every window step."""
    old = update = recompute = 0.0
    for length in prompt_lengths:
        for context in (length, 0):
            f = row_flops(cfg, latent_tokens, context, kind=kind, rank=rank, targets=targets)
            old += window * f.forward
            update += window * (f.forward + f.act_grad + f.weight_grad)
            recompute += window * f.recompute
    return {"old": old, "update": update, "recompute": recompute}


def nft_pass_flops(
    cfg: BagelConfig,
    latent_tokens: int,
    prompt_lengths: list[int],
    times: int,
    *,
    kind: str,
    rank: int,
    targets: list[str],
) -> dict[str, float]:
    """FLOPs of one DiffusionNFT step (CFG-free: the conditional branch only): per trajectory and
    trained time, one old-policy forward ("old") and one forward-backward ("update")."""
    old = update = recompute = 0.0
    for length in prompt_lengths:
        f = row_flops(cfg, latent_tokens, length, kind=kind, rank=rank, targets=targets)
        old += times * f.forward
        update += times * (f.forward + f.act_grad + f.weight_grad)
        recompute += times * f.recompute
    return {"old": old, "update": update, "recompute": recompute}


def spec_flops_per_sample(cfg: BagelConfig, latent_tokens: int, prompt_len: int) -> float:
    """SPEC section 7's forward count of one sample's CFG step (both branches, no LoRA)."""
    return sum(
        row_flops(cfg, latent_tokens, context, kind="lora", rank=0, targets=[]).forward
        for context in (prompt_len, 0)
    )


ForwardRows = dict[tuple[str, bool, int], int]
"""The velocity forwards a step ran (``trainer_step.counting_forwards``): rows by (pass: "old",
the objective's work before the updates, FlowGRPO's logp_old recompute; "update", the rest),
whether they ran with gradients, and their context length."""


def counted_flops(
    cfg: BagelConfig,
    rows: ForwardRows,
    latent_tokens: int,
    *,
    kind: str,
    rank: int,
    targets: list[str],
) -> dict[str, float]:
    """FLOPs of the forwards a step ran (any algorithm), by the per-row formula above: a row
    without gradients costs F, one with gradients F + Fa + Fw (and, checkpointed, the recompute).
    The LoRA's matmuls count in every row, those of a reference with the adapters off too."""
    out = {"old": 0.0, "update": 0.0, "recompute": 0.0}
    for (phase, grad, context), n in rows.items():
        f = row_flops(cfg, latent_tokens, context, kind=kind, rank=rank, targets=targets)
        out[phase] += n * (f.forward + (f.act_grad + f.weight_grad if grad else 0.0))
        out["recompute"] += n * f.recompute if grad else 0.0
    return out
