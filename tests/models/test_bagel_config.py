"""BAGEL configs: the presets' numbers, the llm_config.json mapping, import without torch."""

from __future__ import annotations

import subprocess
import sys

import pytest

from flowgrpo.models.bagel.config import DRAWER_SIZES, BagelConfig, bagel_7b, tiny


def test_7b_preset_numbers() -> None:
    cfg = bagel_7b()
    assert (cfg.hidden, cfg.layers, cfg.heads, cfg.kv_heads, cfg.head_dim) == (3584, 28, 28, 4, 128)
    assert (cfg.intermediate, cfg.vocab, cfg.rope_theta, cfg.rms_eps) == (18944, 152064, 1e6, 1e-6)
    assert (cfg.max_latent_size, cfg.latent_token_dim, cfg.timestep_dim, cfg.qk_norm) == (64, 64, 256, True)


def test_llm_config_round_trip_and_qwen_keys() -> None:
    """Exact: to_llm_config -> from_llm_config; a published-style Qwen2 config without head_dim."""
    for cfg in (bagel_7b(), tiny()):
        assert BagelConfig.from_llm_config(cfg.to_llm_config(), cfg.max_latent_size) == cfg
    qwen = {
        "hidden_size": 3584,
        "num_hidden_layers": 28,
        "num_attention_heads": 28,
        "num_key_value_heads": 4,
        "intermediate_size": 18944,
        "vocab_size": 152064,
        "rope_theta": 1000000.0,
        "rms_norm_eps": 1e-06,
        "max_position_embeddings": 32768,
    }
    assert BagelConfig.from_llm_config(qwen, max_latent_size=64) == bagel_7b()
    with pytest.raises(ValueError, match="kv_heads"):
        BagelConfig.from_llm_config({**qwen, "num_key_value_heads": 5}, 64)


def test_config_imports_without_torch() -> None:
    code = "import sys; sys.modules['torch'] = None\nimport flowgrpo.models.bagel.config\n"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr


def _parameters_written_out(cfg: BagelConfig) -> int:
    """BAGEL's parameter count from its geometry: per layer two experts (und, gen), each with
    biased q/k/v, o, the q/k norms, a SwiGLU and two RMSNorms; then the embeddings, the LM head,
    the two final norms, the time embedder (sinusoid -> h -> h), vae2llm / llm2vae and the
    latent position table (max_latent_size^2 rows)."""
    h, q, kv, i = cfg.hidden, cfg.heads * cfg.head_dim, cfg.kv_heads * cfg.head_dim, cfg.intermediate
    expert = (h * q + q) + 2 * (h * kv + kv) + q * h + 2 * cfg.head_dim + 3 * h * i + 2 * h
    token = cfg.latent_token_dim
    heads = (cfg.timestep_dim * h + h + h * h + h) + (token * h + h) + (h * token + token)
    return cfg.layers * 2 * expert + 2 * cfg.vocab * h + 2 * h + heads + cfg.max_latent_size**2 * h


@pytest.mark.parametrize("size", sorted(DRAWER_SIZES))
def test_the_drawer_sizes_count_their_parameters(size: str) -> None:
    """The sizes' parameter counts against the formula, and the 300m one is at least 300M with
    half of it the gen path (the issue's "a model of at least 300M parameters")."""
    import torch

    from flowgrpo.models.bagel.config import is_gen_path
    from flowgrpo.models.bagel.model import BagelModel

    cfg = DRAWER_SIZES[size]()
    with torch.device("meta"):
        model = BagelModel(cfg)
    counted = sum(p.numel() for p in model.parameters())
    assert counted == _parameters_written_out(cfg)
    if size == "300m":
        gen = sum(p.numel() for name, p in model.named_parameters() if is_gen_path(name))
        assert counted == 306_918_976 and gen == 152_081_664
        assert cfg.max_latent_size * 16 == 256  # a latent token is 16 px: up to 256 px
