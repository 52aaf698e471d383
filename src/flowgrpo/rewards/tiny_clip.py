"""A random CLIP in the published HF layout, built here from nothing (no download): for tests,
the CPU demo and benchmarks of the real geometry with random weights.

The folder gets what ``PickScore_v1`` + the ``CLIP-ViT-H-14`` processor hold together:
``config.json`` + ``model.safetensors`` (a ``CLIPModel``), a byte-level BPE tokenizer (vocab of
the 512 byte symbols with and without ``</w>``, a few merges, the two CLIP markers) and
``preprocessor_config.json`` (the OpenAI CLIP normalisation, resize + centre crop).
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from flowgrpo.fileio import atomic_write

CLIP_MEAN = [0.48145466, 0.4578275, 0.40821073]
CLIP_STD = [0.26862954, 0.26130258, 0.27577711]
BOS, EOS = "<|startoftext|>", "<|endoftext|>"
MERGES = [("t", "h"), ("th", "e</w>"), ("a", "n"), ("i", "n"), ("o", "n</w>"), ("e", "r</w>")]
LOGIT_SCALE_INIT = 2.6592  # log(1 / 0.07), CLIP's initial temperature


@dataclass(frozen=True)
class ClipGeometry:
    image_size: int
    patch_size: int
    vision_width: int
    vision_layers: int
    vision_heads: int
    text_width: int
    text_layers: int
    text_heads: int
    projection_dim: int
    vocab_size: int = 0  # 0: the tiny tokenizer's size


TINY = ClipGeometry(32, 8, 32, 2, 4, 32, 2, 4, 16)
# laion/CLIP-ViT-H-14-laion2B-s32B-b79K, which PickScore_v1 fine-tunes: ~986M parameters
VIT_H_14 = ClipGeometry(224, 14, 1280, 32, 16, 1024, 24, 16, 1024, vocab_size=49408)
GEOMETRIES = {"tiny": TINY, "vit-h-14": VIT_H_14}


def _byte_symbols() -> list[str]:
    """GPT-2's reversible map of the 256 bytes onto printable characters (CLIP uses it too)."""
    printable = [
        *range(ord("!"), ord("~") + 1),
        *range(ord("¡"), ord("¬") + 1),
        *range(ord("®"), ord("ÿ") + 1),
    ]
    symbols = {b: chr(b) for b in printable}
    extra = 0
    for b in range(256):
        if b not in symbols:
            symbols[b] = chr(256 + extra)
            extra += 1
    return [symbols[b] for b in range(256)]


def tiny_vocab() -> dict[str, int]:
    chars = _byte_symbols()
    tokens = [*chars, *(c + "</w>" for c in chars), *(a + b for a, b in MERGES), BOS, EOS]
    return {token: i for i, token in enumerate(tokens)}


def clip_config(geometry: ClipGeometry, vocab: dict[str, int]) -> Any:
    from transformers import CLIPConfig

    g = geometry
    text = {
        "vocab_size": g.vocab_size or len(vocab), "hidden_size": g.text_width,
        "intermediate_size": 4 * g.text_width, "num_hidden_layers": g.text_layers,
        "num_attention_heads": g.text_heads, "max_position_embeddings": 77, "hidden_act": "gelu",
        "bos_token_id": vocab[BOS], "eos_token_id": vocab[EOS], "pad_token_id": vocab[EOS],
        "projection_dim": g.projection_dim,
    }  # fmt: skip
    vision = {
        "image_size": g.image_size, "patch_size": g.patch_size, "hidden_size": g.vision_width,
        "intermediate_size": 4 * g.vision_width, "num_hidden_layers": g.vision_layers,
        "num_attention_heads": g.vision_heads, "hidden_act": "gelu", "projection_dim": g.projection_dim,
    }  # fmt: skip
    return CLIPConfig(
        text_config=text,
        vision_config=vision,
        projection_dim=g.projection_dim,
        logit_scale_init_value=LOGIT_SCALE_INIT,
    )


def random_clip(geometry: ClipGeometry = TINY, *, seed: int = 0, device: str = "cpu") -> Any:
    """A ``CLIPModel`` of ``geometry`` with random weights (seeded), in eval mode."""
    from transformers import CLIPModel

    target = torch.device(device)
    rngs = [target.index or 0] if target.type == "cuda" else []
    with torch.random.fork_rng(devices=rngs), target:  # the caller's random state is left alone
        torch.manual_seed(seed)
        model: Any = CLIPModel(clip_config(geometry, tiny_vocab()))
    return model.eval()


def save_processor(folder: Path, image_size: int) -> None:
    """The tokenizer files and ``preprocessor_config.json`` of a CLIP processor."""
    from transformers import AutoTokenizer

    atomic_write(folder / "vocab.json", json.dumps(tiny_vocab(), ensure_ascii=False))
    atomic_write(folder / "merges.txt", "#version: 0.2\n" + "".join(f"{a} {b}\n" for a, b in MERGES))
    atomic_write(folder / "tokenizer_config.json", json.dumps({"tokenizer_class": "CLIPTokenizer"}))
    # load the BPE files once and save every file a CLIP tokenizer folder has (tokenizer.json, ...)
    AutoTokenizer.from_pretrained(str(folder), local_files_only=True).save_pretrained(str(folder))
    preprocessor = {
        "image_processor_type": "CLIPImageProcessor",
        "do_resize": True, "size": {"shortest_edge": image_size}, "resample": 3,
        "do_center_crop": True, "crop_size": {"height": image_size, "width": image_size},
        "do_rescale": True, "rescale_factor": 1 / 255, "do_normalize": True,
        "image_mean": CLIP_MEAN, "image_std": CLIP_STD, "do_convert_rgb": True,
    }  # fmt: skip
    atomic_write(folder / "preprocessor_config.json", json.dumps(preprocessor, indent=2))


def make_tiny_clip(folder: str | Path, *, seed: int = 0, geometry: ClipGeometry = TINY) -> Path:
    """Write a random CLIP (``CLIPModel`` + tokenizer + image processor) to ``folder`` in the
    published HF layout; :class:`~flowgrpo.rewards.pickscore.PickScorer` loads it as PickScore."""
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    random_clip(geometry, seed=seed).save_pretrained(str(folder), safe_serialization=True)
    save_processor(folder, geometry.image_size)
    return folder
