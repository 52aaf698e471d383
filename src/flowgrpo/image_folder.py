"""(prompt, image) datasets for supervised fine-tuning: the image-folder layout (the one Hugging
Face ``datasets`` reads as ``imagefolder``)::

    <folder>/metadata.jsonl   one JSON object per line: {"file_name": "0001.png", "text": "a red ..."}
    <folder>/0001.png ...     the images (PNG, JPEG, WebP: anything Pillow opens), any size

Reading checks everything a stranger's folder could get wrong and names the line: a file name
outside the folder, a missing or undecodable image, an empty or overlong text, too many lines, an
image above ``MAX_PIXELS``. Images are converted to RGB, resized (the shorter side to the
resolution, Lanczos) and centre-cropped to a square. Writing is atomic: a temporary folder
renamed into place, so a half-written dataset never exists under its name.
"""

from __future__ import annotations

import json
import os
import shutil
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import numpy.typing as npt
from PIL import Image

METADATA = "metadata.jsonl"
MAX_TEXT_CHARS = 2_000
MAX_LINE_BYTES = 64 * 1024
MAX_PIXELS = 64 * 1024 * 1024  # an image larger than 8k x 8k is refused before it is decoded


class ImageFolderError(ValueError):
    """A folder that is not a readable (prompt, image) dataset; the message names the line."""


@dataclass(frozen=True)
class ImageText:
    """One training pair: the prompt and its image, uint8 [S, S, 3] RGB."""

    text: str
    image: npt.NDArray[np.uint8]


def read_image_folder(folder: str | Path, resolution: int, max_items: int) -> list[ImageText]:
    """Every pair of ``folder`` (in metadata order), each image made ``resolution`` px square.
    Raises ImageFolderError naming the folder, the line and what is wrong."""
    folder = Path(folder)
    records = list(_records(folder, max_items))
    if not records:
        raise ImageFolderError(f"{folder / METADATA} lists no images")
    return [ImageText(text, _load(folder, name, resolution, line)) for line, name, text in records]


def _records(folder: Path, max_items: int) -> Iterator[tuple[int, str, str]]:
    metadata = folder / METADATA
    if not metadata.is_file():
        raise ImageFolderError(f"{folder} is not an image folder: {METADATA} is missing")
    count = 0
    with metadata.open("rb") as lines:
        for number, raw in enumerate(lines, start=1):
            where = f"{metadata}:{number}"
            if len(raw) > MAX_LINE_BYTES:
                raise ImageFolderError(f"{where}: a line of more than {MAX_LINE_BYTES} bytes")
            if not raw.strip():
                continue
            count += 1
            if count > max_items:
                raise ImageFolderError(
                    f"{metadata}: more than {max_items} images (raise sft.data.max_images)"
                )
            yield number, *_record(raw, where)


def _record(raw: bytes, where: str) -> tuple[str, str]:
    try:
        entry = json.loads(raw)
    except (json.JSONDecodeError, UnicodeDecodeError) as error:
        raise ImageFolderError(f"{where}: not a JSON object ({error})") from None
    if not isinstance(entry, dict):
        raise ImageFolderError(f"{where}: not a JSON object")
    name, text = entry.get("file_name"), entry.get("text")
    if not isinstance(name, str) or not name:
        raise ImageFolderError(f"{where}: 'file_name' must be a non-empty string")
    if not isinstance(text, str) or not text.strip():
        raise ImageFolderError(f"{where}: 'text' must be a non-empty string")
    if len(text) > MAX_TEXT_CHARS:
        raise ImageFolderError(f"{where}: 'text' has {len(text)} characters, at most {MAX_TEXT_CHARS}")
    path = Path(name)
    if path.is_absolute() or ".." in path.parts:
        raise ImageFolderError(f"{where}: file_name {name!r} must be a path inside the folder")
    return name, text.strip()


def _load(folder: Path, name: str, resolution: int, line: int) -> npt.NDArray[np.uint8]:
    path = folder / name
    where = f"{folder / METADATA}:{line}"
    if not path.is_file():
        raise ImageFolderError(f"{where}: {path} does not exist")
    try:
        with Image.open(path) as image:
            if image.width * image.height > MAX_PIXELS:
                raise ImageFolderError(
                    f"{where}: {path} is {image.width}x{image.height}, above {MAX_PIXELS:,} pixels"
                )
            return square(image.convert("RGB"), resolution)
    except (OSError, Image.DecompressionBombError) as error:
        raise ImageFolderError(f"{where}: {path} is not an image Pillow can read ({error})") from None


def square(image: Image.Image, side: int) -> npt.NDArray[np.uint8]:
    """The shorter side resized to ``side`` (Lanczos), then the centre ``side`` x ``side``."""
    if image.size != (side, side):
        scale = side / min(image.size)
        size = (max(side, round(image.width * scale)), max(side, round(image.height * scale)))
        image = image.resize(size, Image.Resampling.LANCZOS)
        left, top = (image.width - side) // 2, (image.height - side) // 2
        image = image.crop((left, top, left + side, top + side))
    return np.asarray(image, dtype=np.uint8).copy()


def write_image_folder(folder: str | Path, pairs: Iterable[ImageText]) -> int:
    """Write ``pairs`` as an image folder (PNG files ``00000000.png`` ...), atomically: into a
    hidden temporary folder beside ``folder``, renamed into place at the end (an existing folder
    is replaced). Returns the number of images."""
    folder = Path(folder)
    folder.parent.mkdir(parents=True, exist_ok=True)
    tmp = folder.parent / f".{folder.name}.partial"
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir()
    count = 0
    with (tmp / METADATA).open("w", encoding="utf-8") as metadata:
        for count, pair in enumerate(pairs, start=1):
            name = f"{count - 1:08d}.png"
            Image.fromarray(pair.image, mode="RGB").save(tmp / name, format="PNG")
            metadata.write(json.dumps({"file_name": name, "text": pair.text}) + "\n")
        metadata.flush()
        os.fsync(metadata.fileno())
    if folder.exists():
        shutil.rmtree(folder)
    os.replace(tmp, folder)
    return count
