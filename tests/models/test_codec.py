"""The cell codec (the tiny drawing model's VAE) computes what its docstring says: checked
against the same maps written independently in numpy, through the published file layout."""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

import numpy as np
import pytest
import torch

from flowgrpo.models.bagel.checkpoint import load_vae, make_tiny_drawer, read_bagel_config
from flowgrpo.models.bagel.codec import BACKGROUND, GAIN, cell_codec
from flowgrpo.models.bagel.config import VAEConfig, tiny_drawer, tiny_vae


def cell_means(pixels: np.ndarray) -> np.ndarray:
    """[3, 64, 64] -> [3, 8, 8]: GAIN x the mean of (pixel - background) over each 8x8 cell."""
    diff = pixels - np.array(BACKGROUND)[:, None, None]
    return GAIN * diff.reshape(3, 8, 8, 8, 8).mean(axis=(2, 4))


def upsampled(cells: np.ndarray) -> np.ndarray:
    """The cells / GAIN, then three rounds of: repeat each pixel 2x2, then the [1, 2, 1] / 4 blur
    per axis with zeros outside the image; then the background added back and clamped."""
    x = cells / GAIN
    for _ in range(3):
        x = x.repeat(2, axis=1).repeat(2, axis=2)
        for axis in (1, 2):
            padded = np.pad(x, [(0, 0)] + [(1, 1) if a == axis else (0, 0) for a in (1, 2)])
            lo = np.take(padded, range(0, x.shape[axis]), axis=axis)
            mid = np.take(padded, range(1, x.shape[axis] + 1), axis=axis)
            hi = np.take(padded, range(2, x.shape[axis] + 2), axis=axis)
            x = (lo + 2 * mid + hi) / 4
    return np.clip(x + np.array(BACKGROUND)[:, None, None], -1, 1)


@pytest.fixture(scope="module")
def images() -> np.ndarray:
    rng = np.random.default_rng(0)
    blobs = np.tile(np.array(BACKGROUND)[:, None, None], (4, 1, 64, 64)).astype(np.float64)
    for b in range(4):  # a few coloured squares, as the drawing task's images have
        for _ in range(3):
            x, y, s = rng.integers(0, 50), rng.integers(0, 50), rng.integers(6, 20)
            blobs[b, :, y : y + s, x : x + s] = rng.uniform(-1, 1, size=3)[:, None, None]
    noise = rng.uniform(-1, 1, size=(2, 3, 64, 64))
    return np.concatenate([blobs, noise])


def test_encode_is_the_cell_mean_and_decode_the_upsampled_cells(images: np.ndarray) -> None:
    vae = cell_codec()
    with torch.no_grad():
        latent = vae.encode(torch.from_numpy(images).float()).double().numpy()
        decoded = vae.decode(torch.from_numpy(latent).float()).double().numpy()
    assert latent.shape == (6, 16, 8, 8)
    for b in range(len(images)):
        np.testing.assert_allclose(latent[b, :3], cell_means(images[b]), atol=1e-4)
        np.testing.assert_allclose(decoded[b], upsampled(latent[b, :3]), atol=2e-5)
    assert np.abs(latent[:, 3:]).max() == 0.0  # the other 13 channels carry nothing


def test_the_decoder_is_linear_whatever_the_image_holds() -> None:
    """GroupNorm divides by sqrt(eps) for every image (its content-dependent term ~1e-4): a
    latent and its scaled copy decode to scaled colours, a near-empty one does not blow up."""
    vae = cell_codec()
    rng = torch.Generator().manual_seed(1)
    z = torch.zeros(1, 16, 8, 8)
    z[:, :3] = 0.1 * GAIN * torch.randn(1, 3, 8, 8, generator=rng)  # within [-1, 1] after the background
    background = torch.tensor(BACKGROUND).view(1, 3, 1, 1)
    with torch.no_grad():
        one = vae.decode(z) - background
        two = vae.decode(2 * z) - background
        speck = torch.zeros_like(z)
        speck[0, 0, 4, 4] = 1e-3 * GAIN
        tiny = vae.decode(speck) - background
    torch.testing.assert_close(two, 2 * one, atol=1e-4, rtol=1e-3)
    assert 0 < float(tiny.abs().max()) < 1e-3  # 1e-3 spread by the blur, not renormalised to 1


def test_the_drawer_folder_holds_the_codec_in_the_flux_layout(tmp_path: Path) -> None:
    folder = make_tiny_drawer(tmp_path / "drawer", ["a red blob", "two blue blobs"], seed=0)
    loaded = load_vae(folder)
    assert loaded.config == tiny_vae()
    for (name, a), (_, b) in zip(cell_codec().state_dict().items(), loaded.state_dict().items(), strict=True):
        assert torch.equal(a, b), name
    again = make_tiny_drawer(tmp_path / "again", ["a red blob", "two blue blobs"], seed=0)
    for file in ("ema.safetensors", "ae.safetensors", "tokenizer.json"):
        assert (folder / file).read_bytes() == (again / file).read_bytes()


def test_a_drawer_of_another_geometry_is_written_in_it(tmp_path: Path) -> None:
    """--drawer-size's path: the geometry given is the one the folder holds (here a 2-layer
    drawer of width 64 with a 256 px grid, small enough to write in a test)."""
    geometry = replace(tiny_drawer(), hidden=64, layers=2, intermediate=128, max_latent_size=16)
    folder = make_tiny_drawer(tmp_path / "drawer", ["a red blob"], seed=0, geometry=geometry)
    assert read_bagel_config(folder) == geometry
    assert read_bagel_config(make_tiny_drawer(tmp_path / "tiny", ["a red blob"], seed=0)) == tiny_drawer()


def test_other_widths_are_refused() -> None:
    with pytest.raises(ValueError, match="64 channels at every level"):
        cell_codec(VAEConfig(ch=32, ch_mult=(1, 2, 2, 2), num_res_blocks=0))
