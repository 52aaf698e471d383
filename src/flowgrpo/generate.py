"""``flowgrpo generate``: images from a BAGEL checkpoint, optionally with a policy update applied
(a PEFT LoRA adapter, or the weights of a training run's checkpoint: LoRA or the full gen path),
for people who just want pictures. Evaluation sampling by default: the Euler ODE (noise 0), 50
schedule points, text CFG 4.

Image size: a side is at most what the checkpoint's latent position table covers,
``max_latent_size`` tokens of 16 px (1024 px for BAGEL-7B-MoT, 128 px for the tiny model). Left
unset, height and width are ``default_size`` (1024, BAGEL's usual resolution; ``--run`` passes
the run's ``sampling.resolution``) capped at that limit.

Files: ``<prompt>_<sample>.png``, ``<prompt>`` a file-name-safe slug of the prompt text (a slug
met before gets ``-2``, ``-3``, ...), and ``images.jsonl`` with one record per image.
"""

from __future__ import annotations

import json
import re
import unicodedata
from dataclasses import dataclass
from pathlib import Path

import torch
from PIL import Image

from flowgrpo.fileio import atomic_output, atomic_write
from flowgrpo.models.bagel.checkpoint import (
    load_bagel_model,
    load_special_tokens,
    load_vae,
    read_bagel_config,
)
from flowgrpo.models.bagel.config import BagelConfig
from flowgrpo.models.bagel.policy import PolicyApplier, PolicyUpdate
from flowgrpo.models.bagel.sampling import PIXELS_PER_TOKEN, BagelSampler, SampleRequest
from flowgrpo.prompts import PromptTokenizer
from flowgrpo.sampler_params import SamplerParams

USUAL_SIZE = 1024  # px: BAGEL's usual resolution, the default side where the checkpoint allows it
SLUG_CHARS = 60


class GenerateError(ValueError):
    """A request the checkpoint cannot serve (an image size it cannot draw); nothing was written."""


@dataclass(frozen=True)
class GenerateOptions:
    num_images: int = 1  # per prompt
    num_points: int = 50
    cfg_text_scale: float = 4.0
    noise_level: float = 0.0  # 0: the deterministic ODE sampler
    height: int | None = None  # px; None: default_size capped at the checkpoint's limit
    width: int | None = None
    default_size: int = USUAL_SIZE
    seed: int = 0
    device: str = "cpu"
    dtype: str = "float32"
    batch_size: int = 4


def size_limit(config: BagelConfig) -> int:
    """The largest image side (px) the model can draw: its latent grid's side in pixels."""
    return config.max_latent_size * PIXELS_PER_TOKEN


def image_size(options: GenerateOptions, config: BagelConfig) -> tuple[int, int]:
    """(height, width) in px: the options', or the default side; GenerateError names a side the
    checkpoint cannot draw and its limit."""
    limit = size_limit(config)
    default = max(PIXELS_PER_TOKEN, min(options.default_size, limit) // PIXELS_PER_TOKEN * PIXELS_PER_TOKEN)
    height = default if options.height is None else options.height
    width = default if options.width is None else options.width
    for name, size in (("height", height), ("width", width)):
        if size <= 0 or size % PIXELS_PER_TOKEN:
            raise GenerateError(f"image {name} {size} px must be a positive multiple of {PIXELS_PER_TOKEN}")
        if size > limit:
            raise GenerateError(
                f"image {name} {size} px is above this checkpoint's limit of {limit} px "
                f"(max_latent_size {config.max_latent_size} latent tokens of {PIXELS_PER_TOKEN} px)"
            )
    return height, width


def prompt_slug(text: str) -> str:
    """A file-name-safe form of a prompt: ASCII lower-case letters and digits, every other run
    of characters one '-', at most ``SLUG_CHARS`` long; "prompt" when nothing is left."""
    ascii_text = unicodedata.normalize("NFKD", text).encode("ascii", "ignore").decode()
    slug = re.sub(r"[^a-z0-9]+", "-", ascii_text.lower()).strip("-")
    return slug[:SLUG_CHARS].rstrip("-") or "prompt"


def prompt_names(prompts: list[str]) -> list[str]:
    """One distinct file-name stem per prompt: its slug, with ``-2``, ``-3``, ... when taken."""
    names: list[str] = []
    for text in prompts:
        base = name = prompt_slug(text)
        count = 1
        while name in names:
            count += 1
            name = f"{base}-{count}"
        names.append(name)
    return names


def sampler_params(options: GenerateOptions, height: int, width: int) -> SamplerParams:
    """The sampler settings of ``options``: one stochastic step at the start when noise_level > 0."""
    return SamplerParams(
        num_points=options.num_points,
        cfg_text_scale=options.cfg_text_scale,
        noise_level=options.noise_level,
        window_size=1,
        window_range=(0, 1),
        window_strategy="fixed",
        height=height,
        width=width,
    )


def load_sampler(
    checkpoint: str | Path, options: GenerateOptions, update: PolicyUpdate | None
) -> BagelSampler:
    """The model of ``checkpoint`` with ``update`` applied (LoRA merged), and its VAE."""
    dtype = getattr(torch, options.dtype)
    model = load_bagel_model(checkpoint, dtype=dtype, device=options.device).eval()
    if update is not None:
        PolicyApplier(model, version=update.version - 1).apply(update)
    vae = load_vae(checkpoint, dtype=dtype, device=options.device).eval()
    return BagelSampler(model, vae, load_special_tokens(checkpoint))


def generate_images(
    checkpoint: str | Path,
    prompts: list[str],
    out_dir: str | Path,
    options: GenerateOptions,
    update: PolicyUpdate | None = None,
) -> list[Path]:
    """Write ``<out_dir>/<prompt>_<sample>.png`` for every prompt and ``images.jsonl`` beside them.
    ``update``: a policy update applied to the checkpoint's weights first."""
    height, width = image_size(options, read_bagel_config(checkpoint))  # before loading anything
    params = sampler_params(options, height, width)
    sampler = load_sampler(checkpoint, options, update)
    tokenizer = PromptTokenizer.from_checkpoint(checkpoint)
    texts = dict(zip(prompt_names(prompts), prompts, strict=True))
    requests = [
        SampleRequest(name, s, torch.tensor(tokenizer.encode(text).ids))
        for name, text in texts.items()
        for s in range(options.num_images)
    ]
    out = Path(out_dir)
    written, records = [], []
    for start in range(0, len(requests), options.batch_size):
        batch = requests[start : start + options.batch_size]
        images = sampler.generate(batch, params, seed=options.seed, step=0).images
        assert images is not None  # the VAE is loaded
        for request, image in zip(batch, images, strict=True):
            path = out / f"{request.prompt_uid}_{request.sample_index}.png"
            with atomic_output(path) as tmp:
                Image.fromarray(image.cpu().numpy()).save(tmp, format="PNG")
            written.append(path)
            records.append({"file": path.name, "prompt": texts[request.prompt_uid],
                            "sample": request.sample_index, "seed": options.seed,
                            "height": height, "width": width})  # fmt: skip
    atomic_write(out / "images.jsonl", "".join(json.dumps(r) + "\n" for r in records))
    return written
