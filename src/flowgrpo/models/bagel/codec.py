"""The cell codec: an autoencoder in the FLUX layout, constructed (not trained), that keeps the
colour of every 8x8 pixel cell. It is the VAE of the tiny drawing model (``make_tiny_drawer``):
prompt-following images (coloured blobs on a plain background) survive it, and its latent is
a small colour image that a tiny generator can learn to draw.

What it computes, exactly (up to float rounding and a 1e-4 relative term, see below):

- encode: latent channel k < 3 (R, G, B) of cell (i, j) = GAIN x the mean over the cell's 8x8
  pixels of (pixel_k - background_k), pixels in [-1, 1]; channels 3..15 are 0. So the background
  is the zero latent and a colour a vector in three channels;
- decode: pixel_k = background_k + the latent's channel k / GAIN upsampled 8x by three rounds of
  (nearest 2x, then a [1, 2, 1] / 4 blur in each direction), which is bilinear interpolation at
  each round; clamped to [-1, 1]. Channels 3..15 are ignored.

GAIN plays the part of FLUX's scale factor: it brings the latent to about the noise's scale. At
gain 1 the task's colour channels have a standard deviation of 0.17 against the noise's 1, so
the layout of an image only emerges from the noise at t < ~0.15, where the sampler's shifted
schedule takes one or two steps: a model then draws the average of its layouts.

How, in the published FLUX weights (``vae.py``): every residual branch and the attention's output
projection are zero (identity blocks); each downsample is a 2x2 mean and each upsample's conv a
per-channel blur; ``conv_in`` writes each colour as a pair of channels (+s, -s). The layout puts
GroupNorm(32) + swish before ``conv_out`` on both sides: a pair is one group, so its mean is 0,
and the signals are kept so small (SIGNAL) that the group variance is ~1e-4 of GroupNorm's eps
(1e-6): the norm divides by sqrt(eps) whatever the image (its content-dependent part is a factor
1 + var / eps ~ 1 + 1e-4), and swish(u) - swish(-u) = u makes ``conv_out`` linear again.
"""

from __future__ import annotations

import math

import torch
from torch import nn

from flowgrpo.models.bagel.config import VAEConfig, tiny_vae
from flowgrpo.models.bagel.vae import AutoEncoder, Downsample, Upsample

# The plain background of the drawing task (a mid-dark grey, in [-1, 1]): the zero latent.
BACKGROUND = (-0.6, -0.6, -0.6)
COLOUR_CHANNELS = 3
GAIN = 4.0  # latent units per unit of colour difference (the task's colour channels: std ~0.7)
# The size of the signals between conv_in and norm_out: their variance (<= 4 SIGNAL^2 = 1e-10)
# is 1e-4 of GroupNorm's eps (1e-6), so the norm is a fixed division by sqrt(eps).
SIGNAL = 5e-6
NORM_EPS = 1e-6
BLUR = torch.tensor([[1.0, 2.0, 1.0], [2.0, 4.0, 2.0], [1.0, 2.0, 1.0]]) / 16


def cell_codec(config: VAEConfig | None = None) -> AutoEncoder:
    """The cell codec in ``config``'s geometry (default: the tiny VAE's: 64 channels at every one
    of its four levels, 8x downsampling, 16 latent channels)."""
    cfg = config or tiny_vae()
    widths = {cfg.ch * m for m in cfg.ch_mult}
    if widths != {64}:
        raise ValueError(
            "the cell codec needs 64 channels at every level (GroupNorm(32) groups of two), "
            f"got {sorted(widths)}"
        )
    vae = AutoEncoder(cfg)
    with torch.no_grad():
        for p in vae.parameters():
            p.zero_()
        for module in vae.modules():
            if isinstance(module, nn.GroupNorm):
                module.weight.fill_(1.0)
            if isinstance(module, Downsample):
                for c in range(module.conv.out_channels):
                    module.conv.weight[c, c, :2, :2] = 0.25  # the 2x2 mean (FLUX pads right/bottom)
            if isinstance(module, Upsample):
                for c in range(module.conv.out_channels):
                    module.conv.weight[c, c] = BLUR
        # every ResnetBlock and AttnBlock weight stays zero: each is the identity (skip + 0)
        _encoder(vae, cfg)
        _decoder(vae, cfg)
    return vae.eval()


def _pairs(conv: nn.Conv2d, gain: float, bias: tuple[float, ...]) -> None:
    """conv_in: channel 2k = gain * (input_k + bias_k), channel 2k + 1 its negative (centre tap)."""
    assert conv.bias is not None  # FLUX's convs carry biases
    for k in range(COLOUR_CHANNELS):
        conv.weight[2 * k, k, 1, 1] = gain
        conv.weight[2 * k + 1, k, 1, 1] = -gain
        conv.bias[2 * k] = gain * bias[k]
        conv.bias[2 * k + 1] = -gain * bias[k]


def _unnormalised(norm: nn.GroupNorm) -> float:
    """What ``norm`` divides a signal by (sqrt(eps)): its affine weight undoes it."""
    return math.sqrt(norm.eps)


def _encoder(vae: AutoEncoder, cfg: VAEConfig) -> None:
    encoder = vae.encoder
    assert encoder is not None
    _pairs(encoder.conv_in, SIGNAL, tuple(-b for b in BACKGROUND))
    # after norm_out: +-(pixel - background) * SIGNAL / sqrt(eps); conv_out brings it back to
    # GAIN x (pixel - background) and adds the shift that encode() subtracts, divided by the
    # scale that encode() multiplies by: the normalised latent is GAIN x the colour difference
    undo = _unnormalised(encoder.norm_out) / SIGNAL / cfg.scale * GAIN
    for k in range(COLOUR_CHANNELS):
        encoder.conv_out.weight[k, 2 * k, 1, 1] = undo
        encoder.conv_out.weight[k, 2 * k + 1, 1, 1] = -undo
    assert encoder.conv_out.bias is not None
    encoder.conv_out.bias[: cfg.z_channels] = cfg.shift
    encoder.conv_out.bias[cfg.z_channels :] = -30.0  # log-variance: a posterior as sharp as it gets


def _decoder(vae: AutoEncoder, cfg: VAEConfig) -> None:
    decoder = vae.decoder
    # decode() hands the decoder z / scale + shift: conv_in takes the shift back out and the
    # scale back in, so the pairs carry SIGNAL * (normalised latent) / GAIN
    gain = SIGNAL * cfg.scale / GAIN
    _pairs(decoder.conv_in, gain, tuple(-cfg.shift for _ in range(COLOUR_CHANNELS)))
    undo = _unnormalised(decoder.norm_out) / SIGNAL
    assert decoder.conv_out.bias is not None
    for k in range(COLOUR_CHANNELS):
        decoder.conv_out.weight[k, 2 * k, 1, 1] = undo
        decoder.conv_out.weight[k, 2 * k + 1, 1, 1] = -undo
        decoder.conv_out.bias[k] = BACKGROUND[k]
