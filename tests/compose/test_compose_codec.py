"""The task and the tiny drawing model's autoencoder (the cell codec) agree: the task's
background is the codec's zero latent, and the numpy codec the measurements use is the model's."""

from __future__ import annotations

import numpy as np
import torch

from flowgrpo.compose.grammar import all_specs
from flowgrpo.compose.measure import cell_codec, noise_image
from flowgrpo.compose.palette import BACKGROUND
from flowgrpo.compose.render import render
from flowgrpo.compose.verify import verify
from flowgrpo.models.bagel import codec
from flowgrpo.models.bagel.vae import images_to_uint8


def test_the_background_is_the_codecs_zero_latent() -> None:
    assert tuple(round((b + 1) * 127.5) for b in codec.BACKGROUND) == BACKGROUND


def test_the_numpy_codec_is_the_models_and_its_images_pass() -> None:
    specs = all_specs()[::9]
    images = [render(s, np.random.default_rng(i)) for i, s in enumerate(specs)]
    images.append(noise_image(np.random.default_rng(0)))
    pixels = torch.from_numpy(np.stack(images)).permute(0, 3, 1, 2).float() / 127.5 - 1.0
    vae = codec.cell_codec()
    with torch.no_grad():
        decoded = images_to_uint8(vae.decode(vae.encode(pixels))).numpy()
    ours = np.stack([cell_codec(image) for image in images])
    assert np.abs(decoded.astype(int) - ours.astype(int)).max() <= 1  # float32 against float64 rounding
    for spec, image in zip(specs, decoded, strict=False):
        assert verify(spec, image).correct, spec
