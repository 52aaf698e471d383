"""Images of a target text: one line of text drawn with PIL in a DejaVu font (numpy + Pillow).

``render(text, np.random.default_rng(seed), config)`` is a deterministic function of (text,
seed, config): the font (from ``config.fonts``), its size, the background and text colours and
the position are drawn from the generator. Sizes are shares of the image height: the default
64 x 128 image gets fonts of 20-27 px (DejaVu Sans: x-height 11-15 px, capitals and digits
15-20 px; the offline OCR reads such glyphs at 1.00, SPEC section 4), smaller only when a long
line must fit the width, never below ``min_font_px``.

The fonts are Debian's ``fonts-dejavu-core`` (Bitstream Vera licence; installed on this image
under /usr/share/fonts/truetype/dejavu); a missing font file is a one-line :class:`FontMissing`.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import cache
from pathlib import Path

import numpy as np
import numpy.typing as npt
from PIL import Image, ImageDraw, ImageFont

from flowgrpo.fields import check_ranges, knob

FONT_DIR = "/usr/share/fonts/truetype/dejavu"
FONTS = ("DejaVuSans.ttf", "DejaVuSans-Bold.ttf")  # both in fonts-dejavu-core
COLOUR_TRIES = 1_000  # colour pairs drawn before giving up (the default contrast passes ~40%)


class FontMissing(FileNotFoundError):
    """A font file the renderer was asked to use is not there."""


@dataclass
class RenderConfig:
    height: int = knob(64, 16, 1024)
    width: int = knob(128, 16, 2048)
    font_dir: str = FONT_DIR
    fonts: tuple[str, ...] = FONTS
    font_size: tuple[float, float] = knob((0.32, 0.42), 0.05, 1.0)  # font px / image height
    min_font_px: int = knob(16, 4, 512)  # a line that fits only below this is refused
    margin: float = knob(0.06, 0.0, 0.4)  # free border around the text, a share of the height
    # |luminance(text) - luminance(background)| / 255 at least (Rec. 601 weights)
    min_contrast: float = knob(0.45, 0.0, 0.9)

    def validate(self) -> None:
        check_ranges(self, "render")
        if self.font_size[0] > self.font_size[1]:
            raise ValueError(f"render.font_size {self.font_size} is not (low, high)")
        if not self.fonts:
            raise ValueError("render.fonts is empty: name at least one font file")


def render(text: str, rng: np.random.Generator, config: RenderConfig | None = None) -> npt.NDArray[np.uint8]:
    """uint8 [height, width, 3]: ``text`` on one line, font, size, colours and place drawn."""
    config = config or RenderConfig()
    config.validate()
    if not text.strip():
        raise ValueError("render: the text is empty")
    for font_name in config.fonts:  # every font, not only the one drawn: a missing one fails at once
        font_path(config.font_dir, font_name)
    name = config.fonts[int(rng.integers(len(config.fonts)))]
    px = fitting_size(text, name, round(float(rng.uniform(*config.font_size)) * config.height), config)
    font = load_font(config.font_dir, name, px)
    background, ink = colours(rng, config.min_contrast)
    left, top, right, bottom = font.getbbox(text)
    margin = round(config.margin * config.height)
    x = float(rng.uniform(margin, config.width - margin - (right - left)))
    y = float(rng.uniform(margin, max(margin, config.height - margin - (bottom - top))))
    image = Image.new("RGB", (config.width, config.height), background)
    ImageDraw.Draw(image).text((x - left, y - top), text, fill=ink, font=font)
    return np.asarray(image)


def fitting_size(text: str, name: str, px: int, config: RenderConfig) -> int:
    """``px``, or the largest size below it at which ``text`` fits the width inside the margins
    (and its height inside the image); ValueError when that is below ``min_font_px``."""
    room = config.width - 2 * round(config.margin * config.height)
    while px >= config.min_font_px:
        left, top, right, bottom = load_font(config.font_dir, name, px).getbbox(text)
        if right - left <= room and bottom - top <= config.height:
            return px
        px -= 1
    raise ValueError(
        f"render: {text!r} does not fit {config.width} px in {name} at {config.min_font_px} px or more"
    )


RGB = tuple[int, int, int]


def colours(rng: np.random.Generator, min_contrast: float) -> tuple[RGB, RGB]:
    """A (background, text) pair of RGB colours whose luminances differ by ``min_contrast``."""
    weights = np.array([0.299, 0.587, 0.114])
    for _ in range(COLOUR_TRIES):
        pair = rng.integers(0, 256, (2, 3))
        if abs(float((pair[0] - pair[1]) @ weights)) >= min_contrast * 255:
            bg, ink = pair.tolist()
            return (bg[0], bg[1], bg[2]), (ink[0], ink[1], ink[2])
    raise RuntimeError(f"render: no colour pair with contrast {min_contrast} in {COLOUR_TRIES} draws")


@cache
def font_path(font_dir: str, name: str) -> Path:
    path = Path(font_dir) / name
    if not path.is_file():
        raise FontMissing(
            f"font {path} is missing: install Debian's fonts-dejavu-core or set render.font_dir/fonts"
        )
    return path


@cache
def load_font(font_dir: str, name: str, px: int) -> ImageFont.FreeTypeFont:
    return ImageFont.truetype(str(font_path(font_dir, name)), px)
