"""BAGEL configs: the presets' numbers, the llm_config.json mapping, import without torch."""

from __future__ import annotations

import subprocess
import sys

import pytest

from flowgrpo.models.bagel.config import BagelConfig, bagel_7b, tiny


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
