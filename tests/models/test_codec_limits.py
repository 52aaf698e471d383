"""What any autoencoder in the FLUX layout can express (issue #62 item 3, docs/ocr_task.md): the
only resampling is a nearest 2x upsample (decoder) or a stride-2 conv (encoder), every other
operation is a convolution, a GroupNorm over the whole image or a global attention. So, for ANY
weights, a spatially constant latent decodes to an image constant away from the borders, and an
image periodic with the 8 px cell encodes to a constant latent there: no autoencoder of this
layout keeps detail that repeats with the cell. A linear decoder is then a box over the cell
convolved with a filter (its response has zeros at the cell's harmonics), which is why a linear
codec cannot keep text: measured in the doc."""

from __future__ import annotations

import torch

from flowgrpo.models.bagel.config import tiny_vae
from flowgrpo.models.bagel.vae import AutoEncoder

GRID = 24  # latent cells per side: the borders' zero padding reaches ~9 cells in
INNER = slice(10 * 8, 14 * 8)  # pixels of the central 4 cells


def _random_vae() -> AutoEncoder:
    vae = AutoEncoder(tiny_vae()).eval()
    generator = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for p in vae.parameters():  # every weight nonzero: no identity blocks, no zero branches
            p.copy_(torch.randn(p.shape, generator=generator) * (0.5 / max(1, p[0].numel()) ** 0.5))
    return vae


def test_a_constant_latent_decodes_to_a_constant_image_whatever_the_weights() -> None:
    vae = _random_vae()
    z = torch.randn(2, 16, 1, 1).expand(2, 16, GRID, GRID).contiguous()
    varied = z + 0.5 * torch.randn(2, 16, GRID, GRID, generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        flat = vae.decoder(z)[..., INNER, INNER]
        busy = vae.decoder(varied)[..., INNER, INNER]
    spread = busy.std(dim=(2, 3)).min()
    assert spread > 1e-2  # the network is not trivially flat
    assert flat.std(dim=(2, 3)).max() < 1e-5 * spread.item() + 1e-6


def test_an_image_periodic_with_the_cell_encodes_to_a_constant_latent() -> None:
    vae = _random_vae()
    cell = torch.rand(1, 3, 8, 8, generator=torch.Generator().manual_seed(2)) * 2 - 1  # stripes, dots
    image = cell.repeat(1, 1, GRID, GRID)
    shifted = torch.roll(image, shifts=(3, 5), dims=(2, 3))  # the same pattern, off the cell grid
    with torch.no_grad():
        latent = vae.encode(torch.cat([image, shifted]))[..., 10:14, 10:14]
    assert latent.std(dim=(2, 3)).max() < 1e-5
    # periodic at the cell, the place of the pattern inside the cell still changes the latent
    assert (latent[0] - latent[1]).abs().max() > 1e-3
