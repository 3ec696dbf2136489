"""Reading one request's image file, as the vision handlers need: a PNG or JPEG, refused
by its header where it has more pixels than the model allows, before any pixel is
decoded (a small compressed file can inflate to gigabytes).

Every refusal is a HandlerError naming the field ("image: ..."), a 400 for that request
alone: a file that is not a PNG or JPEG, a truncated one, one past the pixel limit.
Pixels are turned as the file's EXIF orientation says and converted to RGB, as
transformers' own `load_image` reads an image.

Optional key in omni-model.toml: `max_pixels` (width x height, default 4096 x 4096).
"""

from __future__ import annotations

import io
from pathlib import Path

import numpy as np
from PIL import Image, ImageOps, UnidentifiedImageError

from omni.instance.handler import HandlerError

from .model_config import read_model_config
from .tensors import single_bytes

DEFAULT_MAX_PIXELS = 4096 * 4096
FORMATS = ("PNG", "JPEG")  # the only decoders Pillow may try on a request's bytes


def max_pixels(model_dir: Path) -> int:
    """The model's pixel limit, from its settings."""
    limit = int(read_model_config(model_dir).get("max_pixels", DEFAULT_MAX_PIXELS))
    if limit < 1:
        raise ValueError(f"max_pixels = {limit}: at least 1")
    return limit


def read_image(request: dict[str, np.ndarray], limit: int, name: str = "image") -> Image.Image:
    """The request's BYTES tensor `name` decoded as an RGB image of at most `limit` pixels."""
    return decode_image(single_bytes(request, name), limit, name)


def decode_image(data: bytes, limit: int, name: str = "image") -> Image.Image:
    """`data`, a PNG or JPEG file, as an RGB image; refused as HandlerError naming `name`."""
    try:
        with Image.open(io.BytesIO(data), formats=FORMATS) as image:  # the header only
            check_size(image.size, limit, name)
            return ImageOps.exif_transpose(image).convert("RGB")
    except Image.DecompressionBombError as e:  # past twice Pillow's own limit
        raise HandlerError(f"{name}: too many pixels ({e})") from e
    except (OSError, SyntaxError, ValueError) as e:  # Pillow's ways of saying a file is bad
        why = "" if isinstance(e, UnidentifiedImageError) else f" ({e})"  # (names a buffer)
        raise HandlerError(f"{name}: not a PNG or JPEG file Pillow can read{why}") from e


def check_size(size: tuple[int, int], limit: int, name: str) -> None:
    width, height = size
    if width * height > limit:
        raise HandlerError(f"{name}: {width}x{height} is {width * height} pixels, at most {limit}")
