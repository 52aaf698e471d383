"""The colours blobs are drawn in and the background they are drawn on (pure Python).

Chosen so that the verifier can classify a pixel by the *direction* of its colour away from the
background: a blob blurred into the background, or desaturated towards mid grey, keeps its
direction and only loses magnitude. The background is mid grey, so every colour lies far from
it, and the directions of any two colours are at least 59 degrees apart (the six hues are about
60 degrees apart around the grey axis; white and black lie on it, 61 degrees or more from every
hue). Orange is left out: it lies within 30 degrees of red and of yellow.
"""

from __future__ import annotations

from flowgrpo.compose.grammar import Colour

RGB = tuple[int, int, int]

BACKGROUND: RGB = (128, 128, 128)
PALETTE: dict[Colour, RGB] = {
    "red": (220, 40, 40),
    "yellow": (230, 210, 40),
    "green": (40, 180, 60),
    "cyan": (30, 210, 200),
    "blue": (50, 70, 220),
    "purple": (170, 60, 200),
    "white": (240, 240, 240),
    "black": (20, 20, 20),
}
