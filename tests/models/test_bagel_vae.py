"""The FLUX autoencoder: geometry from tensor shapes, key layout, decode shape, range and formula."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from flowgrpo.models.bagel.config import VAEConfig, flux_vae, tiny_vae
from flowgrpo.models.bagel.vae import AutoEncoder, decode_in_batches, images_to_uint8, vae_config_from_shapes


def shapes_of(vae: AutoEncoder) -> dict[str, tuple[int, ...]]:
    return {k: tuple(v.shape) for k, v in vae.state_dict().items()}


def test_flux_geometry_round_trips_through_shapes() -> None:
    """Exact: the published geometry (ch 128, mult 1,2,4,4, 2 blocks, z 16) is recovered from the
    shapes alone; ~84M parameters under the original FLUX key names."""
    with torch.device("meta"):
        vae = AutoEncoder(flux_vae())
    shapes = shapes_of(vae)
    assert vae_config_from_shapes(shapes) == flux_vae()
    assert sum(v.numel() for v in vae.state_dict().values()) == 83_819_683
    for key in [
        "encoder.down.0.downsample.conv.weight",
        "encoder.mid.attn_1.proj_out.weight",
        "decoder.up.3.upsample.conv.weight",
        "decoder.up.1.block.0.nin_shortcut.weight",
        "decoder.mid.block_2.norm2.bias",
    ]:
        assert key in shapes, key
    assert "decoder.up.0.upsample.conv.weight" not in shapes  # level 0 is full resolution
    assert shapes["encoder.conv_out.weight"] == (32, 512, 3, 3)  # mean and log-variance


def test_small_and_decoder_only_geometries_are_inferred() -> None:
    """Exact: other widths, depths and a file without encoder keys load by shape."""
    cfg = VAEConfig(ch=32, ch_mult=(1, 2), num_res_blocks=1, z_channels=4)
    with torch.device("meta"):
        vae = AutoEncoder(cfg)
    shapes = shapes_of(vae)
    assert vae_config_from_shapes(shapes) == cfg
    decoder_only = {k: v for k, v in shapes.items() if k.startswith("decoder.")}
    inferred = vae_config_from_shapes(decoder_only)
    assert not inferred.has_encoder and inferred.ch_mult == (1, 2) and inferred.z_channels == 4
    with pytest.raises(ValueError, match=r"decoder\.conv_in\.weight"):
        vae_config_from_shapes({k: v for k, v in decoder_only.items() if k != "decoder.conv_in.weight"})


@torch.no_grad()
def test_decode_shape_range_and_formula() -> None:
    """Bitwise: decode(z) == decoder(z / 0.3611 + 0.1159) clamped to [-1, 1]; 8x upsampling;
    uint8 conversion (x * 0.5 + 0.5) * 255."""
    torch.manual_seed(0)
    vae = AutoEncoder(tiny_vae()).eval()
    assert vae.config.downsample == 8
    z = torch.randn(2, 16, 4, 6)
    images = vae.decode(z)
    assert images.shape == (2, 3, 32, 48)
    assert images.min() >= -1 and images.max() <= 1
    assert torch.equal(images, vae.decoder(z / 0.3611 + 0.1159).clamp(-1, 1))
    pixels = images_to_uint8(images)
    assert pixels.shape == (2, 32, 48, 3) and pixels.dtype == torch.uint8
    assert images_to_uint8(torch.tensor([-1.0, 0.0, 1.0]).view(1, 3, 1, 1)).flatten().tolist() == [
        0,
        128,
        255,
    ]
    assert vae.encode(images).shape == (2, 16, 4, 6)


@pytest.mark.parametrize("layout", [torch.contiguous_format, torch.channels_last])
def test_an_image_decoded_in_fixed_batches_does_not_depend_on_its_companions(
    layout: torch.memory_format,
) -> None:
    """The CPU rollout decodes channels-last in batches of 16 (engine.py). Bitwise: an image
    decoded among 20 others, alone, or at another place of another batch comes out the same (the
    last batch padded to the fixed shape); to float rounding: as one plain batch decodes it. The
    uint8 images come out [B, H, W, 3] contiguous, at most one level from the plain decode's."""
    torch.manual_seed(0)
    vae = AutoEncoder(VAEConfig(ch=64, ch_mult=(1, 1, 1, 1), num_res_blocks=0)).eval()
    z = torch.randn(21, 16, 8, 8)
    with torch.no_grad():
        plain = vae.decode(z)
        vae.to(memory_format=layout)
        batched = decode_in_batches(vae, z, 4)
        alone = decode_in_batches(vae, z[13:14], 4)
        shifted = decode_in_batches(vae, torch.cat([z[5:], z[:5]]), 4)
    assert batched.shape == plain.shape
    assert torch.equal(alone[0], batched[13])
    assert torch.equal(shifted, torch.cat([batched[5:], batched[:5]]))
    torch.testing.assert_close(batched, plain, rtol=1e-4, atol=1e-5)
    pixels = images_to_uint8(batched)
    assert pixels.shape == (21, 64, 64, 3)
    assert (pixels.int() - images_to_uint8(plain).int()).abs().max() <= 1
    if layout == torch.channels_last:
        assert vae.decoder.conv_in.weight.is_contiguous(memory_format=torch.channels_last)
        assert pixels.is_contiguous()


def test_the_tiny_factorys_decoder_is_a_smooth_map_of_the_latent() -> None:
    """smooth_tiny_decoder_: each pixel is sum_g w_g s_g / rms(s_g) of signals s linear in the
    latent (the construction in docs/ARCHITECTURE.md), checked against that formula computed
    here from the weights; and what the demo relies on: varied images, flattened by a shift."""
    from flowgrpo.models.bagel.checkpoint import smooth_tiny_decoder_

    torch.manual_seed(0)
    vae = smooth_tiny_decoder_(AutoEncoder(tiny_vae())).eval()
    z = torch.randn(4, 16, 1, 1).expand(4, 16, 2, 2).contiguous()  # spatially constant latents
    z[:, :, 0, 0] += 0.5  # one corner differs
    decoder = vae.decoder
    with torch.no_grad():
        images = decoder(z / vae.config.scale + vae.config.shift)
        # the formula, from the weights: signals (the +s channels), upsampled like the decoder does
        s = F.conv2d(z / vae.config.scale + vae.config.shift, decoder.conv_in.weight[0::2], padding=1)
        for level in reversed(decoder.up):
            if level.upsample is not None:
                s = level.upsample(s.repeat_interleave(2, dim=1))[:, 0::2]
        rms = s.pow(2).mean(dim=(2, 3), keepdim=True).add(1e-6).sqrt()
        expected = F.conv2d(s / rms, decoder.conv_out.weight[:, 0::2], padding=1)
        assert torch.allclose(images, expected, atol=1e-4)
        pixels = vae.decode(torch.randn(8, 16, 8, 8))
        flatter = vae.decode(torch.randn(8, 16, 8, 8) + 10.0)
    assert pixels.std(dim=0).mean() > 0.2  # different latents, different images
    assert flatter.std(dim=(2, 3)).mean() < 0.5 * pixels.std(dim=(2, 3)).mean()
