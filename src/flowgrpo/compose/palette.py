"""The colours blobs are drawn in and the background they are drawn on (pure Python).

The background is the cell codec's (``flowgrpo.models.bagel.codec.BACKGROUND``, -0.6 in [-1, 1]:
51 of 255), the tiny drawing model's zero latent: a plain background encodes to nothing, and the
decoder's zero padding at the image border is background too (on any other grey the codec would
draw a frame of its own grey along the border). A test checks the two agree; this module stays free of torch.

The colours are chosen so that the verifier can classify a pixel by the *direction* of its
colour away from the background: a blob blurred into the background, or faded towards it (a
latent drawn too small), keeps its direction and only loses magnitude. Seen from a dark
background, colours point into little more than one octant, so there is room for seven: the
three primaries and three secondaries with their unused channel at 0 (as far from each other as
the [0, 255] cube allows), the secondaries kept dim enough to stay away from white. Any two
directions are at least 54 degrees apart, and every colour is at least 156 from the background.
Black cannot be seen on a dark background; orange would lie within 30 degrees of red and yellow.
"""

from __future__ import annotations

from flowgrpo.compose.grammar import Colour

RGB = tuple[int, int, int]

BACKGROUND: RGB = (51, 51, 51)
PALETTE: dict[Colour, RGB] = {
    "red": (210, 0, 0),
    "yellow": (160, 150, 0),
    "green": (0, 210, 0),
    "cyan": (0, 150, 160),
    "blue": (0, 0, 220),
    "purple": (150, 0, 160),
    "white": (220, 220, 220),
}
