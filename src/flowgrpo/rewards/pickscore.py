"""PickScore: a CLIP model scores how well an image matches its caption.

score = exp(logit_scale) * cos(text_emb, image_emb) / 26, embeddings L2-normalised, the text
truncated to 77 tokens (as PickScore was trained; typically 0.8-0.9 with the real weights). The model
folder holds ``config.json`` + ``model.safetensors`` of a ``CLIPModel`` (``PickScore_v1``); the
processor folder the tokenizer and ``preprocessor_config.json`` (``CLIP-ViT-H-14``, as published
beside it); :func:`flowgrpo.rewards.tiny_clip.make_tiny_clip` writes both in one folder.
Batched; on the device given (no environment variables); fp32 unless told otherwise.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np
import numpy.typing as npt
import torch
from PIL import Image

from flowgrpo.rewards.base import Outcome, Sample, SampleScore, Scorer

SCALE = 26.0
MAX_TEXT_TOKENS = 77
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def load_clip(model_dir: str | Path, device: str = "cpu", dtype: str = "float32") -> Any:
    """A ``transformers.CLIPModel`` from a local folder, in eval mode on ``device``."""
    from transformers import CLIPModel

    model: Any = CLIPModel.from_pretrained(str(model_dir), dtype=DTYPES[dtype], local_files_only=True)
    return model.to(torch.device(device)).eval()


def load_processor(processor_dir: str | Path) -> tuple[Any, Any]:
    """The (tokenizer, image processor) of a CLIP processor folder. The image processor is the
    PIL one, as the published PickScore was evaluated with (transformers 5 otherwise picks a
    torchvision processor when torchvision is installed, whose resizing differs slightly)."""
    import transformers

    # transformers >= 5 names the PIL processor CLIPImageProcessorPil; in 4 it is the default one
    image_processor = getattr(transformers, "CLIPImageProcessorPil", transformers.CLIPImageProcessor)
    tokenizer = transformers.AutoTokenizer.from_pretrained(str(processor_dir), local_files_only=True)
    return tokenizer, image_processor.from_pretrained(str(processor_dir), local_files_only=True)


class PickScorer(Scorer):
    """PickScore of each image against its caption (``ground_truth``, else the prompt)."""

    def __init__(
        self,
        model: Any,
        tokenizer: Any,
        image_processor: Any,
        *,
        batch_size: int = 32,
        name: str = "pickscore",
    ) -> None:
        if batch_size < 1:
            raise ValueError(f"pickscore batch_size {batch_size} must be >= 1")
        self.name = name
        self.model = model
        self.tokenizer = tokenizer
        self.image_processor = image_processor
        self.batch_size = batch_size
        self.max_text_tokens = min(MAX_TEXT_TOKENS, model.config.text_config.max_position_embeddings)

    @classmethod
    def from_folders(
        cls,
        model_dir: str | Path,
        processor_dir: str | Path | None = None,
        *,
        device: str = "cpu",
        dtype: str = "float32",
        batch_size: int = 32,
        name: str = "pickscore",
    ) -> PickScorer:
        tokenizer, image_processor = load_processor(processor_dir or model_dir)
        model = load_clip(model_dir, device, dtype)
        return cls(model, tokenizer, image_processor, batch_size=batch_size, name=name)

    @property
    def device(self) -> torch.device:
        device: torch.device = next(self.model.parameters()).device
        return device

    def score(self, samples: Sequence[Sample]) -> list[Outcome]:
        scores: list[Outcome] = []
        for start in range(0, len(samples), self.batch_size):
            chunk = samples[start : start + self.batch_size]
            values = self.scores([s.image for s in chunk], [s.ground_truth or s.prompt for s in chunk])
            scores.extend(SampleScore(float(v)) for v in values.tolist())
        return scores

    @torch.inference_mode()
    def scores(self, images: Sequence[npt.NDArray[np.uint8]], captions: Sequence[str]) -> torch.Tensor:
        """PickScore of each (image, caption) pair, fp32 on the CPU: [B]."""
        image_emb = self.image_features(self.preprocess(images))
        text_emb = self.text_features(self.tokenize(captions))
        cosine = (image_emb * text_emb).sum(dim=-1)
        scale: torch.Tensor = self.model.logit_scale.float().exp()
        return (scale * cosine / SCALE).cpu()

    def preprocess(self, images: Sequence[npt.NDArray[np.uint8]]) -> torch.Tensor:
        """The processor's pixel values [B, 3, S, S] (resize, centre crop, normalise; on the CPU,
        with PIL), moved to the model's device and dtype."""
        pixels = self.image_processor(images=[Image.fromarray(i) for i in images], return_tensors="pt")
        pixel_values: torch.Tensor = pixels["pixel_values"]
        return pixel_values.to(self.device, self.model.dtype)

    def tokenize(self, captions: Sequence[str]) -> dict[str, torch.Tensor]:
        """Token ids and attention mask, captions truncated to 77 tokens, on the model's device."""
        tokens = self.tokenizer(
            list(captions),
            padding=True,
            truncation=True,
            max_length=self.max_text_tokens,
            return_tensors="pt",
        )
        return {name: tokens[name].to(self.device) for name in ("input_ids", "attention_mask")}

    def image_features(self, pixel_values: torch.Tensor) -> torch.Tensor:
        """L2-normalised fp32 image embeddings [B, D]."""
        pooled = self.model.vision_model(pixel_values=pixel_values).pooler_output
        embeddings: torch.Tensor = self.model.visual_projection(pooled)
        return _normalised(embeddings)

    def text_features(self, tokens: dict[str, torch.Tensor]) -> torch.Tensor:
        """L2-normalised fp32 text embeddings [B, D]."""
        pooled = self.model.text_model(**tokens).pooler_output
        embeddings: torch.Tensor = self.model.text_projection(pooled)
        return _normalised(embeddings)

    def close(self) -> None:
        self.model = None
        if torch.cuda.is_available():
            torch.cuda.empty_cache()


def _normalised(embeddings: torch.Tensor) -> torch.Tensor:
    return torch.nn.functional.normalize(embeddings.float(), dim=-1)
