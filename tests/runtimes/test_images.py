"""Reading a request's image: PNG and JPEG decoded to RGB as Pillow reads them bare, the
pixel limit checked on the header before any pixel is decoded, and every bad file refused
with a message that names the field."""

from __future__ import annotations

import io

import numpy as np
import pytest
from PIL import Image

from omni.instance.handler import HandlerError
from omni.runtimes.images import DEFAULT_MAX_PIXELS, decode_image, max_pixels, read_image
from omni.runtimes.model_config import CONFIG_NAME

from .conftest import as_request
from .vision import bad_files, decoded, encoded, photo, png_claiming


@pytest.mark.parametrize("fmt", ["PNG", "JPEG"])
def test_png_and_jpeg_decode_to_rgb_as_pillow_reads_them(fmt):
    file = encoded(photo("coffee"), fmt)
    image = decode_image(file, DEFAULT_MAX_PIXELS)
    assert image.mode == "RGB" and image.size == (80, 53)
    np.testing.assert_array_equal(np.asarray(image), np.asarray(decoded(file)))


@pytest.mark.parametrize("mode", ["L", "RGBA", "P"])
def test_grey_transparent_and_palette_images_become_rgb(mode):
    file = encoded(np.asarray(Image.fromarray(photo("chelsea")).convert(mode)))
    image = decode_image(file, DEFAULT_MAX_PIXELS)
    assert image.mode == "RGB" and image.size == (80, 53)


def test_the_exif_orientation_is_applied():
    exif = Image.Exif()
    exif[0x0112] = 6  # stored sideways: turn 90 degrees clockwise to view
    buffer = io.BytesIO()
    Image.fromarray(photo("coffee")).save(buffer, format="JPEG", exif=exif)
    assert decode_image(buffer.getvalue(), DEFAULT_MAX_PIXELS).size == (53, 80)


@pytest.mark.parametrize("kind", bad_files())
def test_a_bad_file_is_refused_naming_the_field(kind):
    with pytest.raises(HandlerError, match=r"^photo: not a PNG or JPEG file"):
        decode_image(bad_files()[kind], DEFAULT_MAX_PIXELS, name="photo")


def test_the_pixel_limit_is_checked_on_the_header_before_decoding():
    # the file ends after its header: decoding any pixel would fail as truncated
    with pytest.raises(HandlerError, match=r"^image: 8000x6000 is 48000000 pixels, at most"):
        decode_image(png_claiming(8000, 6000), DEFAULT_MAX_PIXELS)
    with pytest.raises(HandlerError, match=r"^image: 80x80 is 6400 pixels, at most 6399$"):
        decode_image(encoded(photo("astronaut")), 6399)
    assert decode_image(encoded(photo("astronaut")), 6400).size == (80, 80)


def test_a_decompression_bomb_past_pillows_own_limit_is_refused():
    limit = 100_000 * 100_000  # a model that would take it: Pillow's guard still holds
    with pytest.raises(HandlerError, match=r"^image: too many pixels"):
        decode_image(png_claiming(100_000, 100_000), limit)


def test_a_request_with_no_single_bytes_element_is_refused_naming_the_field():
    two = {"image": np.array([b"a", b"b"], dtype=object)}
    with pytest.raises(HandlerError, match="'image'"):
        read_image(two, DEFAULT_MAX_PIXELS)
    file = encoded(photo("rocket"))
    assert read_image(as_request(image=file), DEFAULT_MAX_PIXELS).size == (80, 53)


def test_max_pixels_comes_from_the_model_settings(tmp_path):
    assert max_pixels(tmp_path) == DEFAULT_MAX_PIXELS == 4096 * 4096
    (tmp_path / CONFIG_NAME).write_text("max_pixels = 1024\n")
    assert max_pixels(tmp_path) == 1024
    (tmp_path / CONFIG_NAME).write_text("max_pixels = 0\n")
    with pytest.raises(ValueError, match="max_pixels"):
        max_pixels(tmp_path)
