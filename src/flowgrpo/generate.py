"""``flowgrpo generate``: images from a BAGEL checkpoint (and optionally a LoRA adapter), for
people who just want pictures. Evaluation sampling by default: the Euler ODE (noise 0), 50
schedule points, text CFG 4."""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import torch
from PIL import Image

from flowgrpo.fileio import atomic_output, atomic_write
from flowgrpo.models.bagel.checkpoint import load_bagel_model, load_special_tokens, load_vae
from flowgrpo.models.bagel.peft_format import load_peft_adapter
from flowgrpo.models.bagel.policy import PolicyApplier
from flowgrpo.models.bagel.sampling import BagelSampler, SampleRequest, SamplerParams
from flowgrpo.prompts import PromptTokenizer
from flowgrpo.sampler_math import CfgParams, WindowParams


@dataclass(frozen=True)
class GenerateOptions:
    num_images: int = 1  # per prompt
    num_points: int = 50
    cfg_text_scale: float = 4.0
    noise_level: float = 0.0  # 0: the deterministic ODE sampler
    height: int = 512
    width: int = 512
    seed: int = 0
    device: str = "cpu"
    dtype: str = "float32"
    batch_size: int = 4


def generate_images(
    checkpoint: str | Path,
    prompts: list[str],
    out_dir: str | Path,
    options: GenerateOptions,
    lora: str | None = None,
) -> list[Path]:
    """Write ``<out_dir>/<prompt>_<sample>.png`` for every prompt and ``images.jsonl`` beside them."""
    dtype = getattr(torch, options.dtype)
    model = load_bagel_model(checkpoint, dtype=dtype, device=options.device).eval()
    if lora:
        PolicyApplier(model).apply(load_peft_adapter(lora))
    vae = load_vae(checkpoint, dtype=dtype, device=options.device).eval()
    sampler = BagelSampler(model, vae, load_special_tokens(checkpoint))
    tokenizer = PromptTokenizer.from_checkpoint(checkpoint)
    params = SamplerParams(
        num_points=options.num_points,
        cfg=CfgParams(text_scale=options.cfg_text_scale),
        noise_level=options.noise_level,
        window=WindowParams(size=1, lo=0, hi=1, strategy="fixed"),
        height=options.height,
        width=options.width,
    )
    requests = [
        SampleRequest(f"prompt{p}", s, torch.tensor(tokenizer.encode(text).ids))
        for p, text in enumerate(prompts)
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
            text = prompts[int(request.prompt_uid.removeprefix("prompt"))]
            records.append(
                {"file": path.name, "prompt": text, "sample": request.sample_index, "seed": options.seed}
            )
    atomic_write(out / "images.jsonl", "".join(json.dumps(r) + "\n" for r in records))
    return written
