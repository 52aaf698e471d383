"""PickScore on a tiny random CLIP that our own code builds and saves in the published HF layout:
our formula equals transformers' CLIPModel computing exp(logit_scale) * cos itself."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

from flowgrpo.rewards import Sample, SampleScore  # noqa: E402
from flowgrpo.rewards.pickscore import PickScorer  # noqa: E402
from flowgrpo.rewards.tiny_clip import make_tiny_clip  # noqa: E402

CAPTIONS = ["a red fox in the snow", "the cat in the hat", "an orange " * 60, ""]


@pytest.fixture(scope="module")
def clip_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_tiny_clip(tmp_path_factory.mktemp("clip") / "tiny-clip", seed=3)


def images(n: int) -> list[np.ndarray]:
    rng = np.random.default_rng(0)
    return [rng.integers(0, 256, (40 + 8 * i, 56, 3), dtype=np.uint8) for i in range(n)]


def reference(folder: Path, imgs: list[np.ndarray], captions: list[str]) -> list[float]:
    """transformers' own CLIPModel forward: logits_per_image = exp(logit_scale) * cos; / 26."""
    from PIL import Image

    model = transformers.CLIPModel.from_pretrained(str(folder)).eval()
    processor = transformers.CLIPProcessor.from_pretrained(str(folder))
    scores = []
    with torch.no_grad():
        for image, caption in zip(imgs, captions, strict=True):
            inputs = processor(text=[caption], images=[Image.fromarray(image)], return_tensors="pt",
                               padding=True, truncation=True, max_length=77)  # fmt: skip
            scores.append(model(**inputs).logits_per_image.item() / 26)
    return scores


def test_the_folder_has_the_published_layout(clip_dir: Path) -> None:
    names = {p.name for p in clip_dir.iterdir()}
    assert {"config.json", "model.safetensors", "preprocessor_config.json", "tokenizer.json",
            "tokenizer_config.json", "vocab.json", "merges.txt"} <= names  # fmt: skip


def test_pickscore_equals_a_direct_clipmodel_computation(clip_dir: Path) -> None:
    imgs = images(len(CAPTIONS))
    scorer = PickScorer.from_folders(clip_dir, batch_size=3)
    ours = scorer.score([Sample(image, prompt=c) for image, c in zip(imgs, CAPTIONS, strict=True)])
    expected = reference(clip_dir, imgs, CAPTIONS)
    assert all(isinstance(o, SampleScore) for o in ours)
    values = [o.value for o in ours if isinstance(o, SampleScore)]
    assert values == pytest.approx(expected, abs=1e-5, rel=1e-5)
    # the caption is the ground truth when there is one
    [with_caption] = scorer.score([Sample(imgs[0], prompt="ignored", ground_truth=CAPTIONS[0])])
    assert isinstance(with_caption, SampleScore) and with_caption.value == pytest.approx(values[0], abs=1e-6)


def test_batching_does_not_change_scores(clip_dir: Path) -> None:
    imgs = images(4)
    samples = [Sample(image, prompt=c) for image, c in zip(imgs, CAPTIONS, strict=True)]
    one = PickScorer.from_folders(clip_dir, batch_size=1).score(samples)
    four = PickScorer.from_folders(clip_dir, batch_size=4).score(samples)
    assert [o.value for o in one] == pytest.approx([o.value for o in four], abs=1e-5)  # type: ignore[union-attr]


def test_the_factory_is_deterministic_per_seed(tmp_path: Path, clip_dir: Path) -> None:
    again = make_tiny_clip(tmp_path / "again", seed=3)
    assert (again / "model.safetensors").read_bytes() == (clip_dir / "model.safetensors").read_bytes()
