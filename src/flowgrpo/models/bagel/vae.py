"""The FLUX.1 autoencoder BAGEL decodes its latents with, under the original FLUX key names
(``encoder.*``, ``decoder.*``) so ``ae.safetensors`` loads 1:1.

Layout: levels of ResNet blocks (GroupNorm(32, eps 1e-6), swish, 3x3 convs, a 1x1 shortcut where
the width changes), a 2x down/upsample between levels, a mid block with one single-head
self-attention, GroupNorm + swish + conv out. The latent is normalised: encode returns
scale * (z - shift), decode takes z / scale + shift. Geometry is read from tensor shapes
(``vae_config_from_shapes``), so smaller autoencoders in the same layout load too.
"""

from __future__ import annotations

import itertools
from collections.abc import Mapping, Sequence

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from flowgrpo.models.bagel.config import VAEConfig


def group_norm(channels: int) -> nn.GroupNorm:
    return nn.GroupNorm(num_groups=32, num_channels=channels, eps=1e-6, affine=True)


class ResnetBlock(nn.Module):
    def __init__(self, in_channels: int, out_channels: int) -> None:
        super().__init__()
        self.norm1 = group_norm(in_channels)
        self.conv1 = nn.Conv2d(in_channels, out_channels, kernel_size=3, padding=1)
        self.norm2 = group_norm(out_channels)
        self.conv2 = nn.Conv2d(out_channels, out_channels, kernel_size=3, padding=1)
        # Only blocks that change the width carry a shortcut conv (and a key for it).
        self.nin_shortcut = (
            nn.Conv2d(in_channels, out_channels, kernel_size=1) if in_channels != out_channels else None
        )

    def forward(self, x: Tensor) -> Tensor:
        h = self.conv1(F.silu(self.norm1(x)))
        h = self.conv2(F.silu(self.norm2(h)))
        skip = x if self.nin_shortcut is None else self.nin_shortcut(x)
        return skip + h  # type: ignore[no-any-return]


class AttnBlock(nn.Module):
    """Single-head self-attention over all pixels, 1x1-conv projections."""

    def __init__(self, channels: int) -> None:
        super().__init__()
        self.norm = group_norm(channels)
        self.q = nn.Conv2d(channels, channels, kernel_size=1)
        self.k = nn.Conv2d(channels, channels, kernel_size=1)
        self.v = nn.Conv2d(channels, channels, kernel_size=1)
        self.proj_out = nn.Conv2d(channels, channels, kernel_size=1)

    def forward(self, x: Tensor) -> Tensor:
        b, c, h, w = x.shape
        normed = self.norm(x)

        def pixels(conv: nn.Conv2d) -> Tensor:  # [B, C, H, W] -> [B, 1, H * W, C]
            return conv(normed).flatten(2).transpose(1, 2)[:, None]  # type: ignore[no-any-return]

        out = F.scaled_dot_product_attention(pixels(self.q), pixels(self.k), pixels(self.v))
        out = out[:, 0].transpose(1, 2).reshape(b, c, h, w)
        return x + self.proj_out(out)  # type: ignore[no-any-return]


class Downsample(nn.Module):
    def __init__(self, channels: int) -> None:
        super().__init__()
        self.conv = nn.Conv2d(channels, channels, kernel_size=3, stride=2, padding=0)

    def forward(self, x: Tensor) -> Tensor:
        # FLUX pads right and bottom only (torch convs pad symmetrically).
        return self.conv(F.pad(x, (0, 1, 0, 1)))  # type: ignore[no-any-return]


class Upsample(nn.Module):
    def __init__(self, channels: int) -> None:
        super().__init__()
        self.conv = nn.Conv2d(channels, channels, kernel_size=3, padding=1)

    def forward(self, x: Tensor) -> Tensor:
        return self.conv(F.interpolate(x, scale_factor=2.0, mode="nearest"))  # type: ignore[no-any-return]


class MidBlock(nn.Module):
    def __init__(self, channels: int) -> None:
        super().__init__()
        self.block_1 = ResnetBlock(channels, channels)
        self.attn_1 = AttnBlock(channels)
        self.block_2 = ResnetBlock(channels, channels)

    def forward(self, x: Tensor) -> Tensor:
        return self.block_2(self.attn_1(self.block_1(x)))  # type: ignore[no-any-return]


class Level(nn.Module):
    """One resolution: ``block.{i}`` then a ``downsample`` (encoder) or ``upsample`` (decoder),
    absent at the deepest level. The FLUX code's ``attn`` lists are empty (no weights) and left out."""

    def __init__(self, channels: Sequence[int], resample: Downsample | Upsample | None) -> None:
        super().__init__()
        self.block = nn.ModuleList(ResnetBlock(a, b) for a, b in itertools.pairwise(channels))
        self.downsample = resample if isinstance(resample, Downsample) else None
        self.upsample = resample if isinstance(resample, Upsample) else None

    def forward(self, x: Tensor) -> Tensor:
        for block in self.block:
            x = block(x)
        if self.downsample is not None:
            x = self.downsample(x)
        if self.upsample is not None:
            x = self.upsample(x)
        return x


class Encoder(nn.Module):
    def __init__(self, cfg: VAEConfig) -> None:
        super().__init__()
        widths = [cfg.ch * m for m in cfg.ch_mult]
        self.conv_in = nn.Conv2d(cfg.in_channels, cfg.ch, kernel_size=3, padding=1)
        self.down = nn.ModuleList()
        width = cfg.ch
        for i, out in enumerate(widths):
            last = i == len(widths) - 1
            channels = [width] + [out] * cfg.num_res_blocks
            self.down.append(Level(channels, None if last else Downsample(out)))
            width = out
        self.mid = MidBlock(width)
        self.norm_out = group_norm(width)
        # Mean and log-variance of the latent.
        self.conv_out = nn.Conv2d(width, 2 * cfg.z_channels, kernel_size=3, padding=1)

    def forward(self, x: Tensor) -> Tensor:
        h = self.conv_in(x)
        for level in self.down:
            h = level(h)
        h = self.mid(h)
        return self.conv_out(F.silu(self.norm_out(h)))  # type: ignore[no-any-return]


class Decoder(nn.Module):
    def __init__(self, cfg: VAEConfig) -> None:
        super().__init__()
        widths = [cfg.ch * m for m in cfg.ch_mult]
        width = widths[-1]
        self.conv_in = nn.Conv2d(cfg.z_channels, width, kernel_size=3, padding=1)
        self.mid = MidBlock(width)
        # ``up.{i}`` is indexed by resolution level (0 = full resolution) but runs deepest first.
        levels: list[nn.Module] = []
        for i in reversed(range(len(widths))):
            channels = [width] + [widths[i]] * (cfg.num_res_blocks + 1)
            levels.insert(0, Level(channels, Upsample(widths[i]) if i else None))
            width = widths[i]
        self.up = nn.ModuleList(levels)
        self.norm_out = group_norm(width)
        self.conv_out = nn.Conv2d(width, cfg.out_channels, kernel_size=3, padding=1)

    def forward(self, z: Tensor) -> Tensor:
        h = self.mid(self.conv_in(z))
        for level in reversed(self.up):
            h = level(h)
        return self.conv_out(F.silu(self.norm_out(h)))  # type: ignore[no-any-return]


class AutoEncoder(nn.Module):
    def __init__(self, cfg: VAEConfig) -> None:
        super().__init__()
        self.config = cfg
        self.encoder = Encoder(cfg) if cfg.has_encoder else None
        self.decoder = Decoder(cfg)

    def encode(self, images: Tensor) -> Tensor:
        """Images [B, 3, H, W] in [-1, 1] -> normalised latent [B, z, H/f, W/f]: the posterior
        mean (deterministic; the reference samples, which text-to-image never needs)."""
        if self.encoder is None:
            raise RuntimeError("this autoencoder was loaded without encoder weights")
        mean, _logvar = self.encoder(images).chunk(2, dim=1)
        return self.config.scale * (mean - self.config.shift)  # type: ignore[no-any-return]

    def decode(self, z: Tensor) -> Tensor:
        """Normalised latent [B, z, h, w] -> images [B, 3, h*f, w*f] clamped to [-1, 1]."""
        images: Tensor = self.decoder(z / self.config.scale + self.config.shift)
        return images.clamp(-1.0, 1.0)


def decode_in_batches(vae: AutoEncoder, z: Tensor, size: int) -> Tensor:
    """``vae.decode(z)`` in batches of exactly ``size`` latents, the last one padded with zeros
    (dropped after); ``size`` 0: one batch. A convolution library picks its kernel and blocking
    from the batch's shape, so an image decoded in a fixed shape does not depend on how many
    others were decoded with it (two rollout replicas decoding 8 images each draw what one
    decoding 16 draws), and a small batch keeps the activations in cache (docs/LOG.md)."""
    if size <= 0:
        return vae.decode(z)
    parts = []
    for start in range(0, z.shape[0], size):
        part = z[start : start + size]
        count = part.shape[0]
        if count < size:
            part = torch.cat([part, part.new_zeros(size - count, *part.shape[1:])])
        parts.append(vae.decode(part)[:count])
    return torch.cat(parts)


def images_to_uint8(images: Tensor) -> Tensor:
    """[B, 3, H, W] in [-1, 1] -> [B, H, W, 3] uint8: round(255 clamp((x + 1) / 2, 0, 1))."""
    pixels = ((images.float() * 0.5 + 0.5).clamp(0, 1) * 255).round().to(torch.uint8)
    return pixels.permute(0, 2, 3, 1)


def _count(prefix: str, shapes: Mapping[str, Sequence[int]]) -> int:
    """How many consecutive ``{prefix}{i}.`` indices exist."""
    i = 0
    while any(k.startswith(f"{prefix}{i}.") for k in shapes):
        i += 1
    return i


def vae_config_from_shapes(
    shapes: Mapping[str, Sequence[int]], scale: float = 0.3611, shift: float = 0.1159
) -> VAEConfig:
    """The geometry of an ``ae.safetensors`` from its tensor shapes (decoder keys; the encoder is
    built when its keys are present). Raises ValueError naming the key that is missing."""

    def shape(key: str) -> Sequence[int]:
        if key not in shapes:
            raise ValueError(f"cannot infer the VAE geometry: key {key!r} is missing")
        return shapes[key]

    levels = _count("decoder.up.", shapes)
    if levels == 0:
        raise ValueError("cannot infer the VAE geometry: no 'decoder.up.{i}.' keys")
    widths = [shape(f"decoder.up.{i}.block.0.conv2.weight")[0] for i in range(levels)]
    ch = widths[0]
    if any(w % ch for w in widths):
        raise ValueError(f"VAE level widths {widths} are not multiples of the first one")
    return VAEConfig(
        ch=ch,
        ch_mult=tuple(w // ch for w in widths),
        num_res_blocks=_count("decoder.up.0.block.", shapes) - 1,
        z_channels=shape("decoder.conv_in.weight")[1],
        in_channels=shapes["encoder.conv_in.weight"][1] if "encoder.conv_in.weight" in shapes else 3,
        out_channels=shape("decoder.conv_out.weight")[0],
        scale=scale,
        shift=shift,
        has_encoder=any(k.startswith("encoder.") for k in shapes),
    )
