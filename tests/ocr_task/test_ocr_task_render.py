"""The renderer: deterministic in (text, seed, config), jittered font, colours and place, the
text inside the margins at a readable size, and one-line errors for a missing font or a line
that does not fit."""

from __future__ import annotations

import numpy as np
import pytest

from flowgrpo.fields import FieldError
from flowgrpo.ocr_task.render import FontMissing, RenderConfig, colours, fitting_size, render

LUMA = np.array([0.299, 0.587, 0.114])


def _ink_box(image: np.ndarray) -> tuple[int, int, int, int]:
    background = image[0, 0].astype(int)  # the margin keeps the corner free of text
    ink = np.abs(image.astype(int) - background).max(axis=2) > 0
    rows, columns = np.flatnonzero(ink.any(axis=1)), np.flatnonzero(ink.any(axis=0))
    return int(rows[0]), int(rows[-1]), int(columns[0]), int(columns[-1])


def test_rendering_is_deterministic_and_jittered() -> None:
    one = render("gold", np.random.default_rng(5))
    assert one.shape == (64, 128, 3) and one.dtype == np.uint8
    assert (render("gold", np.random.default_rng(5)) == one).all()
    others = [render("gold", np.random.default_rng(seed)) for seed in range(8)]
    assert len({tuple(image[0, 0]) for image in others}) == 8, "background colours differ"
    assert len({_ink_box(image) for image in others}) >= 6, "sizes and places differ"


def test_the_text_stays_inside_the_margins_with_the_contrast_asked() -> None:
    config = RenderConfig()
    margin = round(config.margin * config.height)
    for seed in range(20):
        rng = np.random.default_rng(seed)
        image = render("jousted now", rng, config)
        top, _, left, right = _ink_box(image)
        # anti-aliasing may spill one pixel past the glyph box
        assert top >= margin - 1 and left >= margin - 1 and right <= config.width - margin
        background, ink = colours(np.random.default_rng(seed), config.min_contrast)
        assert abs(float((np.array(background) - np.array(ink)) @ LUMA)) >= 0.45 * 255


def test_long_lines_shrink_to_fit_and_refuse_below_the_minimum() -> None:
    config = RenderConfig()
    assert fitting_size("gold", "DejaVuSans.ttf", 26, config) == 26
    shrunk = fitting_size("jousted now", "DejaVuSans-Bold.ttf", 26, config)
    assert config.min_font_px <= shrunk < 26
    with pytest.raises(ValueError, match=r"does not fit 128 px in DejaVuSans\.ttf at 16 px or more"):
        fitting_size("a line far too long for the image", "DejaVuSans.ttf", 26, config)


def test_a_missing_font_and_bad_settings_are_one_line_errors() -> None:
    with pytest.raises(
        FontMissing, match=r"font /nowhere/DejaVuSans.ttf is missing: install Debian's fonts-dejavu-core"
    ):
        render("gold", np.random.default_rng(0), RenderConfig(font_dir="/nowhere"))
    with pytest.raises(FieldError, match=r"render\.height"):
        render("gold", np.random.default_rng(0), RenderConfig(height=8))
    with pytest.raises(ValueError, match="is not \\(low, high\\)"):
        render("gold", np.random.default_rng(0), RenderConfig(font_size=(0.4, 0.3)))
    with pytest.raises(ValueError, match="the text is empty"):
        render("  ", np.random.default_rng(0))


def test_every_target_of_the_split_fits_every_font_at_the_minimum_size() -> None:
    from flowgrpo.ocr_task.render import FONTS
    from flowgrpo.ocr_task.split import split

    config = RenderConfig()
    for targets in split().values():
        for target in targets:
            for font in FONTS:
                assert fitting_size(target.text, font, config.min_font_px, config) == config.min_font_px
