"""BAGEL checkpoint folders in the published layout: load by path, save, and the tiny factory.

| file | content |
|---|---|
| ``ema.safetensors`` | MoT language model and generation heads (and the ViT, ignored here) |
| ``ae.safetensors`` | FLUX autoencoder, keys ``encoder.*`` / ``decoder.*`` |
| ``llm_config.json`` | Qwen2 config of the decoder |
| ``vit_config.json``, ``config.json`` | ViT and top-level configs (only ``special_token_ids`` is read) |
| ``preprocessor_config.json`` | the ViT's image processor (image understanding; never read here) |
| ``tokenizer.json`` (+ ``tokenizer_config.json``, ``vocab.json``, ``merges.txt``) | tokenizer |

The tiny factory writes this layout in two sizes: the text-to-image subset this project reads,
or, with ``complete=True``, every file and tensor of the published folder (the ViT, connector and
``vit_pos_embed`` weights, ``config.json`` with ``model_type: bagel``, ``preprocessor_config.json``),
which loaders that read the whole published folder strictly (vLLM-Omni's) require.

Every component loads on its own: the model needs ``ema.safetensors`` + ``llm_config.json``
only, the VAE ``ae.safetensors`` only. Keys load 1:1 (module names are the published names);
a missing, mis-shaped or unknown key fails with the keys and the file named. Weights stream
tensor by tensor into a meta-device model (``load_state_dict(assign=True)``), so a 28 GiB file
never exists twice in memory. Only safetensors and JSON are read or written.
"""

from __future__ import annotations

import json
import math
import os
import tempfile
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import replace
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
from safetensors import safe_open
from safetensors.torch import save_file
from torch import Tensor, nn

from flowgrpo.fileio import atomic_output, atomic_write
from flowgrpo.models.bagel.codec import cell_codec
from flowgrpo.models.bagel.config import (
    SPECIAL_TOKEN_NAMES,
    BagelConfig,
    SpecialTokens,
    flux_vae,
    tiny,
    tiny_drawer,
    tiny_vae,
)
from flowgrpo.models.bagel.model import BagelModel, sincos_2d_table
from flowgrpo.models.bagel.vae import AttnBlock, AutoEncoder, ResnetBlock, Upsample, vae_config_from_shapes

if TYPE_CHECKING:
    from tokenizers import Tokenizer

EMA_FILE = "ema.safetensors"
VAE_FILE = "ae.safetensors"
LLM_CONFIG_FILE = "llm_config.json"
VIT_CONFIG_FILE = "vit_config.json"
CONFIG_FILE = "config.json"
PREPROCESSOR_CONFIG_FILE = "preprocessor_config.json"
TOKENIZER_FILE = "tokenizer.json"
TOKENIZER_CONFIG_FILE = "tokenizer_config.json"

# Image-understanding weights in ema.safetensors that text-to-image never uses, and RoPE's
# derived frequency buffer should a file carry it (this model computes it from rope_theta).
IGNORED_PREFIXES = ("vit_model.", "connector.", "vit_pos_embed.", "language_model.model.rotary_emb.")
POS_EMBED_KEY = "latent_pos_embed.pos_embed"


class CheckpointError(ValueError):
    """A checkpoint folder that does not hold what the model needs."""


# --------------------------------------------------------------------------------------------
# Reading
# --------------------------------------------------------------------------------------------


def _require(path: Path) -> Path:
    if not path.is_file():
        raise CheckpointError(f"{path} does not exist")
    return path


def _read_json(path: Path) -> dict[str, Any]:
    data = json.loads(_require(path).read_text())
    if not isinstance(data, dict):
        raise CheckpointError(f"{path} does not hold a JSON object")
    return data


def tensor_shapes(path: Path) -> dict[str, tuple[int, ...]]:
    """Names and shapes from a safetensors header, without reading any tensor."""
    with safe_open(str(_require(path)), framework="pt") as f:
        return {key: tuple(f.get_slice(key).get_shape()) for key in f.keys()}  # noqa: SIM118


def _listed(keys: Iterable[str], limit: int = 8) -> str:
    keys = sorted(keys)
    shown = ", ".join(keys[:limit])
    return f"{len(keys)} ({shown}{', ...' if len(keys) > limit else ''})"


def check_keys(
    expected: Mapping[str, tuple[int, ...]],
    found: Mapping[str, tuple[int, ...]],
    path: Path,
    ignored_prefixes: tuple[str, ...] = (),
) -> None:
    """Raise CheckpointError listing every missing, mis-shaped and unexpected key at once."""
    missing = [k for k in expected if k not in found]
    misshaped = [
        f"{k} {list(found[k])} (model expects {list(shape)})"
        for k, shape in expected.items()
        if k in found and found[k] != shape
    ]
    unexpected = [k for k in found if k not in expected and not k.startswith(ignored_prefixes)]
    problems = []
    if missing:
        problems.append(f"missing keys: {_listed(missing)}")
    if misshaped:
        problems.append(f"mis-shaped keys: {_listed(misshaped)}")
    if unexpected:
        problems.append(f"unexpected keys: {_listed(unexpected)}")
    if problems:
        raise CheckpointError(f"{path} does not fit the model: " + "; ".join(problems))


def _load_into(
    module: nn.Module,
    path: Path,
    dtype: torch.dtype,
    device: torch.device | str,
    ignored_prefixes: tuple[str, ...] = (),
) -> None:
    """Check every key and shape from the header, then read tensor by tensor straight onto
    ``device`` and assign them (``module`` may live on the meta device)."""
    expected = {k: tuple(v.shape) for k, v in module.state_dict().items()}
    check_keys(expected, tensor_shapes(path), path, ignored_prefixes)
    state: dict[str, Tensor] = {}
    with safe_open(str(path), framework="pt", device=str(torch.device(device))) as f:
        for key in expected:
            state[key] = f.get_tensor(key).to(dtype)
    module.load_state_dict(state, strict=True, assign=True)


def checkpoint_key(param_name: str) -> str | None:
    """The ``ema.safetensors`` key of a model parameter; None for a LoRA tensor (not in the file).
    peft keeps an adapted module's own weight under ``<module>.base_layer``."""
    if ".lora_A." in param_name or ".lora_B." in param_name:
        return None
    return param_name.replace(".base_layer", "")


def read_bagel_config(folder: str | Path) -> BagelConfig:
    """The decoder config from ``llm_config.json``; ``max_latent_size`` from the shape of
    ``latent_pos_embed.pos_embed`` in ``ema.safetensors`` (config.json may be stale)."""
    folder = Path(folder)
    shapes = tensor_shapes(folder / EMA_FILE)
    if POS_EMBED_KEY not in shapes:
        raise CheckpointError(f"{folder / EMA_FILE} has no {POS_EMBED_KEY}: cannot size the latent grid")
    rows = shapes[POS_EMBED_KEY][0]
    side = math.isqrt(rows)
    if side * side != rows:
        raise CheckpointError(f"{POS_EMBED_KEY} has {rows} rows, not a square grid")
    return BagelConfig.from_llm_config(_read_json(folder / LLM_CONFIG_FILE), max_latent_size=side)


def load_bagel_model(
    folder: str | Path, dtype: torch.dtype = torch.bfloat16, device: torch.device | str = "cpu"
) -> BagelModel:
    """The MoT model and generation heads from ``ema.safetensors`` + ``llm_config.json`` alone,
    in eval mode, every weight (the position table too) in ``dtype`` on ``device``, frozen.

    Frozen (``requires_grad=False``) because training code unfreezes exactly what it trains, and
    because PyTorch picks a different linear kernel for parameters that require gradients even
    under ``no_grad``: a rollout and a trainer must hold the same flags to compute bitwise-equal
    log-probs."""
    folder = Path(folder)
    cfg = read_bagel_config(folder)
    with torch.device("meta"):
        model = BagelModel(cfg)
    _load_into(model, folder / EMA_FILE, dtype, device, IGNORED_PREFIXES)
    return model.eval().requires_grad_(False)


def load_vae(
    folder: str | Path, dtype: torch.dtype = torch.float32, device: torch.device | str = "cpu"
) -> AutoEncoder:
    """The autoencoder from ``ae.safetensors``, its geometry read from the tensor shapes."""
    path = Path(folder) / VAE_FILE
    shapes = tensor_shapes(path)
    try:
        cfg = vae_config_from_shapes(shapes)
    except ValueError as err:
        raise CheckpointError(f"{path}: {err}") from err
    with torch.device("meta"):
        vae = AutoEncoder(cfg)
    _load_into(vae, path, dtype, device)
    return vae.eval()


def load_special_tokens(folder: str | Path, fallback: SpecialTokens | None = None) -> SpecialTokens:
    """Marker ids from ``tokenizer.json`` when the folder has one, else from the
    ``special_token_ids`` object of ``config.json``, else ``fallback``."""
    folder = Path(folder)
    if (folder / TOKENIZER_FILE).is_file():
        return _special_tokens_from_tokenizer(folder / TOKENIZER_FILE)
    if (folder / CONFIG_FILE).is_file():
        ids = _read_json(folder / CONFIG_FILE).get("special_token_ids")
        if isinstance(ids, dict):
            return SpecialTokens(**{field: int(ids[field]) for field in SPECIAL_TOKEN_NAMES})
    if fallback is not None:
        return fallback
    raise CheckpointError(
        f"{folder} has neither {TOKENIZER_FILE} nor 'special_token_ids' in {CONFIG_FILE}: "
        "pass the special-token ids explicitly"
    )


def _special_tokens_from_tokenizer(path: Path) -> SpecialTokens:
    data = _read_json(path)
    ids = {entry["content"]: int(entry["id"]) for entry in data.get("added_tokens", [])}
    vocab = data.get("model", {}).get("vocab", {})
    found: dict[str, int] = {}
    for field, name in SPECIAL_TOKEN_NAMES.items():
        token_id = ids.get(name, vocab.get(name) if isinstance(vocab, dict) else None)
        if token_id is None:
            raise CheckpointError(f"{path} has no token {name}")
        found[field] = int(token_id)
    return SpecialTokens(**found)


# --------------------------------------------------------------------------------------------
# Writing
# --------------------------------------------------------------------------------------------


def _save_tensors(tensors: Mapping[str, Tensor], path: Path) -> None:
    """safetensors through a temporary name in the same folder, then an atomic rename."""
    cpu = {k: v.detach().to("cpu").contiguous() for k, v in tensors.items()}
    with atomic_output(path) as tmp:
        save_file(cpu, tmp, metadata={"format": "pt"})


def _write_json(path: Path, data: Mapping[str, Any]) -> None:
    atomic_write(path, json.dumps(data, indent=2, sort_keys=True) + "\n")


def save_bagel_checkpoint(
    model: BagelModel,
    vae: AutoEncoder | None,
    folder: str | Path,
    *,
    tokenizer: Tokenizer | None = None,
    special_tokens: SpecialTokens | None = None,
    vit_config: Mapping[str, Any] | None = None,
    understanding: Mapping[str, Tensor] | None = None,
) -> Path:
    """Write ``model`` (and ``vae``, ``tokenizer``) in the published layout; every file atomically.
    Without a tokenizer, ``special_tokens`` go to ``config.json`` so the folder stays usable.
    ``understanding`` (the ViT, connector and ``vit_pos_embed`` tensors under their published
    names, with ``vit_config``) makes the folder complete: ``config.json`` then describes the whole
    published model (``model_type: bagel``, its llm/vit/vae configs) and a
    ``preprocessor_config.json`` is written."""
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    cfg = model.config
    _write_json(folder / LLM_CONFIG_FILE, cfg.to_llm_config())
    if vit_config is not None:
        _write_json(folder / VIT_CONFIG_FILE, vit_config)
    top: dict[str, Any] = {
        "visual_gen": True,
        "visual_und": understanding is not None,
        "latent_patch_size": cfg.patch,
        "max_latent_size": cfg.max_latent_size,
        "timestep_shift": 1.0,
    }
    if understanding is not None:
        if vit_config is None:
            raise ValueError("a complete checkpoint (understanding weights) needs its vit_config")
        top.update(_complete_top_config(cfg, vit_config))
        _write_json(folder / PREPROCESSOR_CONFIG_FILE, _preprocessor_config(vit_config))
    if vae is not None:
        top["vae_config"] = {"z_channels": vae.config.z_channels, "downsample": vae.config.downsample}
    if special_tokens is not None:
        top["special_token_ids"] = {field: getattr(special_tokens, field) for field in SPECIAL_TOKEN_NAMES}
    _write_json(folder / CONFIG_FILE, top)
    if tokenizer is not None:
        _save_tokenizer(tokenizer, folder)
    if vae is not None:
        _save_tensors(vae.state_dict(), folder / VAE_FILE)
    _save_tensors({**model.state_dict(), **(understanding or {})}, folder / EMA_FILE)
    return folder


def _complete_top_config(cfg: BagelConfig, vit_config: Mapping[str, Any]) -> dict[str, Any]:
    """The entries of a published ``config.json`` beyond what this project reads."""
    return {
        "model_type": "bagel",
        "architectures": ["BagelForConditionalGeneration"],
        "llm_config": cfg.to_llm_config(),
        "vit_config": dict(vit_config),
        "vit_max_num_patch_per_side": vit_patches_per_side(vit_config),
        "connector_act": "gelu_pytorch_tanh",
        "interpolate_pos": False,
    }


def _preprocessor_config(vit_config: Mapping[str, Any]) -> dict[str, Any]:
    """SigLIP's image processor at the ViT's image size (as the published folder has it)."""
    side = int(vit_config["image_size"])
    return {
        "image_processor_type": "SiglipImageProcessor",
        "do_resize": True,
        "size": {"height": side, "width": side},
        "resample": 3,
        "do_rescale": True,
        "rescale_factor": 1 / 255,
        "do_normalize": True,
        "image_mean": [0.5, 0.5, 0.5],
        "image_std": [0.5, 0.5, 0.5],
    }


def vit_patches_per_side(vit_config: Mapping[str, Any]) -> int:
    return int(vit_config["image_size"]) // int(vit_config["patch_size"])


def understanding_shapes(vit_config: Mapping[str, Any], llm_hidden: int) -> dict[str, tuple[int, ...]]:
    """Names and shapes of the image-understanding tensors of ``ema.safetensors``: the SigLIP ViT
    (its patch embedding stored flattened, as a linear), the MLP connector into the decoder's
    width, and the ViT tokens' 2-D position table."""
    hidden, inner = int(vit_config["hidden_size"]), int(vit_config["intermediate_size"])
    patch, channels = int(vit_config["patch_size"]), int(vit_config.get("num_channels", 3))
    side = vit_patches_per_side(vit_config)
    vit = "vit_model.vision_model."
    shapes: dict[str, tuple[int, ...]] = {
        vit + "embeddings.patch_embedding.weight": (hidden, channels * patch * patch),
        vit + "embeddings.patch_embedding.bias": (hidden,),
        vit + "embeddings.position_embedding.weight": (side * side, hidden),
        vit + "post_layernorm.weight": (hidden,),
        vit + "post_layernorm.bias": (hidden,),
        "connector.fc1.weight": (llm_hidden, hidden),
        "connector.fc1.bias": (llm_hidden,),
        "connector.fc2.weight": (llm_hidden, llm_hidden),
        "connector.fc2.bias": (llm_hidden,),
        "vit_pos_embed.pos_embed": (side * side, llm_hidden),
    }
    for i in range(int(vit_config["num_hidden_layers"])):
        layer = f"{vit}encoder.layers.{i}."
        for name in ("layer_norm1", "layer_norm2"):
            shapes[layer + name + ".weight"] = shapes[layer + name + ".bias"] = (hidden,)
        for proj in ("q_proj", "k_proj", "v_proj", "out_proj"):
            shapes[f"{layer}self_attn.{proj}.weight"] = (hidden, hidden)
            shapes[f"{layer}self_attn.{proj}.bias"] = (hidden,)
        shapes[layer + "mlp.fc1.weight"], shapes[layer + "mlp.fc1.bias"] = (inner, hidden), (inner,)
        shapes[layer + "mlp.fc2.weight"], shapes[layer + "mlp.fc2.bias"] = (hidden, inner), (hidden,)
    return shapes


def random_understanding(
    vit_config: Mapping[str, Any], llm_hidden: int, generator: torch.Generator
) -> dict[str, Tensor]:
    """Random image-understanding tensors (normal 0.02 weights, zero biases, unit norm scales,
    the exact sin-cos table for ``vit_pos_embed``); text-to-image never runs them."""
    tensors: dict[str, Tensor] = {}
    for name, shape in understanding_shapes(vit_config, llm_hidden).items():
        if name == "vit_pos_embed.pos_embed":
            tensors[name] = sincos_2d_table(llm_hidden, vit_patches_per_side(vit_config))
        elif "layer_norm" in name or "layernorm" in name:
            tensors[name] = torch.ones(shape) if name.endswith(".weight") else torch.zeros(shape)
        elif name.endswith(".bias"):
            tensors[name] = torch.zeros(shape)
        else:
            tensors[name] = torch.randn(shape, generator=generator) * 0.02
    return tensors


def _save_tokenizer(tokenizer: Tokenizer, folder: Path) -> None:
    atomic_write(folder / TOKENIZER_FILE, tokenizer.to_str(pretty=True))
    specials = {
        str(tid): {
            "content": name,
            "special": True,
            "lstrip": False,
            "rstrip": False,
            "normalized": False,
            "single_word": False,
        }
        for name, tid in sorted(tokenizer.get_vocab(with_added_tokens=True).items(), key=lambda kv: kv[1])
        if name.startswith("<|") and name.endswith("|>")
    }
    _write_json(
        folder / TOKENIZER_CONFIG_FILE,
        {
            "tokenizer_class": "Qwen2Tokenizer",
            "added_tokens_decoder": specials,
            "bos_token": None,
            "eos_token": "<|im_end|>",
            "pad_token": "<|endoftext|>",
            "unk_token": None,
            "add_prefix_space": False,
            "clean_up_tokenization_spaces": False,
            "errors": "replace",
            "model_max_length": 32768,
            "split_special_tokens": False,
        },
    )
    # A byte-level BPE also ships as vocab.json + merges.txt, like the Qwen2.5 folder.
    with tempfile.TemporaryDirectory(dir=folder) as tmp:
        for written in tokenizer.model.save(tmp):
            os.replace(written, folder / Path(written).name)


# --------------------------------------------------------------------------------------------
# The tiny checkpoint
# --------------------------------------------------------------------------------------------

TINY_CORPUS = [
    "a photo of a cat sitting on a red chair",
    "a painting of a mountain lake at sunrise",
    "a dog running on the beach with a ball",
    'a sign that says "hello world" in bold letters',
    "an astronaut riding a horse on the moon",
    "a bowl of fruit on a wooden table, studio lighting",
    "two birds flying over a green field under a blue sky",
    "a city street at night with neon lights and rain",
]
TINY_VIT_CONFIG = {
    "model_type": "siglip_vision_model",
    "hidden_size": 32,
    "intermediate_size": 64,
    "num_hidden_layers": 1,
    "num_attention_heads": 2,
    "num_channels": 3,
    "image_size": 28,
    "patch_size": 14,
    "hidden_act": "gelu_pytorch_tanh",
    "layer_norm_eps": 1e-6,
}
# A complete tiny checkpoint's latent grid: 32 tokens per side (512 px), what vLLM-Omni's BAGEL
# pipeline needs (it always warms up at 512x512). The sin-cos table is exact at any size, so the
# sampled images equal those of the smaller grid for every size both allow.
COMPLETE_TINY_MAX_LATENT_SIZE = 32


def build_tiny_tokenizer(vocab_size: int = 384, corpus: Sequence[str] = TINY_CORPUS) -> Tokenizer:
    """A byte-level BPE (any text encodes, no unknown tokens) trained on ``corpus`` (a few
    sentences by default), with ``<|endoftext|>`` and the four markers added under their Qwen names."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        special_tokens=["<|endoftext|>"],
        show_progress=False,
    )
    tokenizer.train_from_iterator(corpus, trainer)
    tokenizer.add_special_tokens(list(SPECIAL_TOKEN_NAMES.values()))
    return tokenizer


def tiny_tokenizer() -> tuple[Tokenizer, SpecialTokens]:
    """The tiny tokenizer and the ids of its markers (any checkpoint with a vocabulary of at least
    388 can use it: the random-7B benchmarks do)."""
    tokenizer = build_tiny_tokenizer()
    ids = {field: tokenizer.token_to_id(name) for field, name in SPECIAL_TOKEN_NAMES.items()}
    return tokenizer, SpecialTokens(**{field: int(i) for field, i in ids.items() if i is not None})


def make_tiny_bagel(
    folder: str | Path, seed: int = 0, *, complete: bool = False, flux_ae: bool = False
) -> Path:
    """Write a tiny checkpoint (weights, VAE, configs, tokenizer) to ``folder``; the same seed gives
    the same bytes. Returns the folder.

    ``complete``: the whole published layout (random ViT, connector and ``vit_pos_embed`` weights,
    the full ``config.json``, ``preprocessor_config.json``) and a 32-token latent grid; the
    generation weights are the same as without it. ``flux_ae``: a random autoencoder in the
    published FLUX geometry (84M parameters, 335 MB) instead of the tiny smooth one, for loaders
    that hard-code that geometry."""
    cfg = tiny()
    if complete:
        cfg = replace(cfg, max_latent_size=COMPLETE_TINY_MAX_LATENT_SIZE)
    tokenizer, specials = tiny_tokenizer()
    if tokenizer.get_vocab_size(with_added_tokens=True) > cfg.vocab:
        raise RuntimeError(f"the tiny tokenizer outgrew the tiny vocabulary of {cfg.vocab}")
    with torch.random.fork_rng(devices=[]):  # seed the default init without touching the caller's RNG
        torch.manual_seed(seed)
        model = BagelModel(cfg)
        vae = smooth_tiny_decoder_(AutoEncoder(tiny_vae()))
        if flux_ae:
            vae = AutoEncoder(flux_vae())
    understanding = None
    if complete:  # its own generator: the generation weights stay those of the plain tiny checkpoint
        generator = torch.Generator().manual_seed(seed + 1)
        understanding = random_understanding(TINY_VIT_CONFIG, cfg.hidden, generator)
    return save_bagel_checkpoint(
        model,
        vae,
        folder,
        tokenizer=tokenizer,
        special_tokens=specials,
        vit_config=TINY_VIT_CONFIG,
        understanding=understanding,
    )


# The drawing model's tokenizer: trained on the task's prompts, large enough that each word of a
# small grammar is one token (what a real tokenizer does for common words)
DRAWER_VOCAB = 500


def make_tiny_drawer(
    folder: str | Path, corpus: Sequence[str], seed: int = 0, geometry: BagelConfig | None = None
) -> Path:
    """Write the untrained drawing model to ``folder``: ``geometry`` (default ``tiny_drawer``;
    ``DRAWER_SIZES`` names the others) with random weights (``seed``), the cell codec as its VAE
    (``codec.py``: the latent is a colour image of the picture's 8x8 cells) and a tokenizer trained
    on ``corpus`` (the task's prompts). The same arguments give the same bytes. ``flowgrpo sft``
    then teaches it to draw."""
    cfg = geometry or tiny_drawer()
    tokenizer = build_tiny_tokenizer(DRAWER_VOCAB, corpus)
    ids = {field: tokenizer.token_to_id(name) for field, name in SPECIAL_TOKEN_NAMES.items()}
    specials = SpecialTokens(**{field: int(i) for field, i in ids.items() if i is not None})
    if tokenizer.get_vocab_size(with_added_tokens=True) > cfg.vocab:
        raise RuntimeError(f"the drawer's tokenizer outgrew its vocabulary of {cfg.vocab}")
    model = BagelModel(cfg)
    model.init_weights(std=0.02, generator=torch.Generator().manual_seed(seed))
    return save_bagel_checkpoint(model, cell_codec(), folder, tokenizer=tokenizer, special_tokens=specials)


def smooth_tiny_decoder_(vae: AutoEncoder) -> AutoEncoder:
    """Give a tiny autoencoder's decoder weights that make it a smooth, well-conditioned map from
    latents to colours (in place; draws from torch's default generator), so that a policy can
    change brightness, colour and contrast, not only noise. Random weights give a decoder whose
    images barely move with the latent: GroupNorm renormalises every channel and random residual
    branches scramble the rest, which left the CPU demo a few percent of headroom at most.

    The construction, in the real FLUX layout (GroupNorm(32) over 64 channels: groups of two):
    ``conv_in`` writes 32 signals s_g (random linear mixes of the 16 latent channels) as the pairs
    (+s_g, -s_g); every residual branch and the attention's output projection are zero (identity
    blocks); each upsample is nearest-neighbour then a 3x3 binomial blur, per channel. A group
    (+s, -s) has mean 0, so ``norm_out`` only divides it by the rms of s over the image, keeping s's
    mean and contrast relative to its size; and silu(a) - silu(-a) = a, so ``conv_out`` (weight w_g
    on +s_g, -w_g on -s_g) makes each pixel the linear map sum_g w_g s_g / rms(s_g): smooth colour
    fields that follow the latent's mean (brightness, colour) and spatial variation (contrast)."""
    decoder = vae.decoder
    width, z_channels = decoder.conv_in.out_channels, decoder.conv_in.in_channels
    if decoder.norm_out.num_groups * 2 != width:
        raise ValueError(f"the smooth decoder needs GroupNorm groups of two channels, got width {width}")
    signals = width // 2
    mix = torch.randn(signals, z_channels) / math.sqrt(z_channels)
    colours = torch.randn(decoder.conv_out.out_channels, signals) * (0.5 / math.sqrt(signals))
    blur = torch.tensor([[1.0, 2.0, 1.0], [2.0, 4.0, 2.0], [1.0, 2.0, 1.0]]) / 16
    with torch.no_grad():
        for module in decoder.modules():
            if isinstance(module, ResnetBlock):
                _zero(module.conv2)
            elif isinstance(module, AttnBlock):
                _zero(module.proj_out)
            elif isinstance(module, Upsample):
                _zero(module.conv)
                for c in range(module.conv.out_channels):
                    module.conv.weight[c, c] = blur
        _zero(decoder.conv_in)
        decoder.conv_in.weight[0::2, :, 1, 1] = mix
        decoder.conv_in.weight[1::2, :, 1, 1] = -mix
        _zero(decoder.conv_out)
        decoder.conv_out.weight[:, 0::2, 1, 1] = colours
        decoder.conv_out.weight[:, 1::2, 1, 1] = -colours
    return vae


def _zero(conv: nn.Conv2d) -> None:
    conv.weight.zero_()
    if conv.bias is not None:
        conv.bias.zero_()


def byte_symbols() -> list[str]:
    """The byte-level alphabet in byte order: symbol ``i`` stands for byte ``i`` (GPT-2's and
    Qwen2's map: printable Latin-1 bytes are themselves, the others 256 + k in order; the space,
    byte 32, is ``Ġ``)."""
    printable = [
        *range(ord("!"), ord("~") + 1),
        *range(ord("¡"), ord("¬") + 1),
        *range(ord("®"), ord("ÿ") + 1),
    ]
    symbols, extra = {}, 0
    for byte in range(256):
        if byte in printable:
            symbols[byte] = chr(byte)
        else:
            symbols[byte] = chr(256 + extra)
            extra += 1
    return [symbols[b] for b in range(256)]


def build_character_tokenizer() -> Tokenizer:
    """A byte-level BPE with no merges: token id ``b`` is byte ``b`` (``byte_symbols``), then
    ``<|endoftext|>`` (256) and the four markers under their Qwen names (257-260). Every text
    encodes (no unknown tokens) and an ASCII character is exactly one token, so a word the model
    never saw is a new sequence of tokens it saw: the tiny models' way to spell unseen words.
    Written like any byte-level BPE (``tokenizer.json`` + ``vocab.json`` + an empty ``merges.txt``)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers

    vocab = {symbol: i for i, symbol in enumerate(byte_symbols())}
    tokenizer = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    tokenizer.add_special_tokens(["<|endoftext|>", *SPECIAL_TOKEN_NAMES.values()])
    return tokenizer
