"""Typed configs of BAGEL's MoT language model and its FLUX autoencoder, with the 7B and tiny presets.

Numbers are the published BAGEL-7B-MoT's. The published ``llm_config.json`` is a plain Qwen2 config;
``qk_norm`` and the MoT layer type are not in it (the reference sets them in code), and
``max_latent_size`` comes from the shape of ``latent_pos_embed.pos_embed``, not from a file.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True)
class BagelConfig:
    """Geometry of the MoT decoder and the generation heads."""

    hidden: int
    layers: int
    heads: int
    kv_heads: int
    head_dim: int
    intermediate: int
    vocab: int
    rope_theta: float = 1e6
    rms_eps: float = 1e-6
    max_latent_size: int = 64  # the latent grid is at most max_latent_size tokens per side
    latent_channels: int = 16
    patch: int = 2  # latent patch side: one token covers patch x patch latent pixels
    qk_norm: bool = True
    timestep_dim: int = 256  # width of the sinusoid fed to the time embedder
    max_position_embeddings: int = 32768  # kept only to write a faithful llm_config.json

    def __post_init__(self) -> None:
        if self.heads % self.kv_heads:
            raise ValueError(f"heads ({self.heads}) must be a multiple of kv_heads ({self.kv_heads})")
        if self.hidden % 4:
            raise ValueError(f"hidden ({self.hidden}) must be divisible by 4 for the 2-D sin-cos table")
        if self.head_dim % 2:
            raise ValueError(f"head_dim ({self.head_dim}) must be even for rotate-half RoPE")
        if not self.qk_norm:
            raise ValueError("BAGEL checkpoints always carry qk-norm weights; qk_norm=False is not supported")

    @property
    def latent_token_dim(self) -> int:
        """Features of one latent token: patch * patch * latent_channels (64 for BAGEL)."""
        return self.patch * self.patch * self.latent_channels

    @classmethod
    def from_llm_config(cls, llm_config: dict[str, Any], max_latent_size: int) -> BagelConfig:
        """Read the Qwen2 keys of ``llm_config.json``; ``max_latent_size`` comes from the weights."""
        hidden = int(llm_config["hidden_size"])
        heads = int(llm_config["num_attention_heads"])
        return cls(
            hidden=hidden,
            layers=int(llm_config["num_hidden_layers"]),
            heads=heads,
            kv_heads=int(llm_config.get("num_key_value_heads", heads)),
            head_dim=int(llm_config.get("head_dim") or hidden // heads),
            intermediate=int(llm_config["intermediate_size"]),
            vocab=int(llm_config["vocab_size"]),
            rope_theta=float(llm_config.get("rope_theta", 1e6)),
            rms_eps=float(llm_config.get("rms_norm_eps", 1e-6)),
            max_latent_size=max_latent_size,
            max_position_embeddings=int(llm_config.get("max_position_embeddings", 32768)),
        )

    def to_llm_config(self) -> dict[str, Any]:
        """The Qwen2 ``llm_config.json`` written next to a checkpoint."""
        return {
            "architectures": ["Qwen2ForCausalLM"],
            "model_type": "qwen2",
            "hidden_act": "silu",
            "hidden_size": self.hidden,
            "num_hidden_layers": self.layers,
            "num_attention_heads": self.heads,
            "num_key_value_heads": self.kv_heads,
            "head_dim": self.head_dim,
            "intermediate_size": self.intermediate,
            "vocab_size": self.vocab,
            "rope_theta": self.rope_theta,
            "rms_norm_eps": self.rms_eps,
            "max_position_embeddings": self.max_position_embeddings,
            "tie_word_embeddings": False,
            "use_sliding_window": False,
        }


def bagel_7b() -> BagelConfig:
    """BAGEL-7B-MoT: a Qwen2.5-7B decoder duplicated into und and gen experts."""
    return BagelConfig(
        hidden=3584,
        layers=28,
        heads=28,
        kv_heads=4,
        head_dim=128,
        intermediate=18944,
        vocab=152064,
        max_latent_size=64,
    )


def tiny() -> BagelConfig:
    """A model small enough for CPU tests; the vocabulary fits the tiny tokenizer and its specials."""
    return BagelConfig(
        hidden=64,
        layers=2,
        heads=4,
        kv_heads=2,
        head_dim=16,
        intermediate=128,
        vocab=512,
        max_latent_size=8,
        max_position_embeddings=1024,
    )


def tiny_drawer() -> BagelConfig:
    """The tiny model that learns to draw (``make_tiny_drawer``, then ``flowgrpo sft``): wide and
    deep enough to place, count and colour objects on a 64 px canvas (4x4 latent tokens), small
    enough to sample and train on two CPU cores."""
    return BagelConfig(
        hidden=128,
        layers=4,
        heads=4,
        kv_heads=2,
        head_dim=32,
        intermediate=384,
        vocab=512,
        max_latent_size=8,
        max_position_embeddings=1024,
    )


def drawer_300m() -> BagelConfig:
    """The drawing model at a size where a GPU matters (306M parameters, half of them the gen
    path): the same task, tokenizer and cell codec as ``tiny_drawer``, BAGEL's layout at 10 layers
    of 1024 (Qwen2's 16 query and 4 key-value heads of 64, a SwiGLU of 4x), a latent grid up to
    16 tokens a side (256 px)."""
    return BagelConfig(
        hidden=1024,
        layers=10,
        heads=16,
        kv_heads=4,
        head_dim=64,
        intermediate=4096,
        vocab=512,
        max_latent_size=16,
        max_position_embeddings=1024,
    )


# ``flowgrpo make-tiny-bagel --drawer PROMPTS --drawer-size NAME``
DRAWER_SIZES = {"tiny": tiny_drawer, "300m": drawer_300m}


@dataclass(frozen=True)
class VAEConfig:
    """Geometry of the FLUX.1 autoencoder. Spatial downsampling is 2 ** (len(ch_mult) - 1)."""

    ch: int = 128  # channels of the first (full resolution) level
    ch_mult: tuple[int, ...] = (1, 2, 4, 4)
    num_res_blocks: int = 2
    z_channels: int = 16
    in_channels: int = 3
    out_channels: int = 3
    scale: float = 0.3611
    shift: float = 0.1159
    has_encoder: bool = True

    def __post_init__(self) -> None:
        for mult in self.ch_mult:
            if (self.ch * mult) % 32:
                raise ValueError(f"GroupNorm(32) needs channels divisible by 32, got {self.ch} * {mult}")

    @property
    def downsample(self) -> int:
        return int(2 ** (len(self.ch_mult) - 1))


def flux_vae() -> VAEConfig:
    """The published ``ae.safetensors`` (about 84M parameters)."""
    return VAEConfig()


def tiny_vae() -> VAEConfig:
    """Same layout and the same 8x downsampling, 64 channels everywhere (GroupNorm(32) groups of
    two: what the tiny factory's smooth decoder needs, see ``smooth_tiny_decoder_``), no extra
    ResNet block per level."""
    return VAEConfig(ch=64, ch_mult=(1, 1, 1, 1), num_res_blocks=0)


@dataclass(frozen=True)
class SpecialTokens:
    """Ids of the four markers the text-to-image sampler uses (read them from the tokenizer)."""

    im_start: int
    im_end: int
    vision_start: int
    vision_end: int


# The names under which the tokenizer holds the markers, by SpecialTokens field.
SPECIAL_TOKEN_NAMES: dict[str, str] = {
    "im_start": "<|im_start|>",
    "im_end": "<|im_end|>",
    "vision_start": "<|vision_start|>",
    "vision_end": "<|vision_end|>",
}


GEN_PATH_MARKER = "moe_gen"


def is_gen_path(name: str) -> bool:
    """A parameter or module of the generation expert (the path FlowGRPO trains; und is frozen)."""
    return GEN_PATH_MARKER in name


TEXT_EMBEDDING = "language_model.model.embed_tokens."


def is_text_path(name: str) -> bool:
    """A parameter of the language half that reads the prompt: the token embeddings and the und
    expert of every decoder layer. Image generation reads the text through each layer's und keys
    and values, so the und final norm, ``lm_head`` and the last layer's queries, output and MLP
    (which make text logits) get no gradient from it."""
    return name.startswith(TEXT_EMBEDDING) or (".layers." in name and not is_gen_path(name))


# The gen path's linear modules inside each decoder layer (LoRA targets are suffixes of these);
# a test checks the list against the model's modules.
GEN_PATH_LINEARS = (
    "self_attn.q_proj_moe_gen",
    "self_attn.k_proj_moe_gen",
    "self_attn.v_proj_moe_gen",
    "self_attn.o_proj_moe_gen",
    "mlp_moe_gen.gate_proj",
    "mlp_moe_gen.up_proj",
    "mlp_moe_gen.down_proj",
)
